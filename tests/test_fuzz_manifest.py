"""Property test: any mutation of a valid manifest either parses or raises ManifestError."""

from __future__ import annotations

import copy
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_edge.errors import ManifestError
from dspark_edge.manifest import MANIFEST_NAME, Manifest

VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
                   st.text(max_size=8), st.lists(st.integers(-2, 5), max_size=3), st.dictionaries(
                       st.text(max_size=4), st.integers(), max_size=2))


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutations_parse_or_raise_manifest_error(tiny_engine, data):
    base = json.loads((tiny_engine / MANIFEST_NAME).read_text())
    doc = copy.deepcopy(base)
    paths = [p for p in _paths(doc) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            action = data.draw(st.sampled_from(["replace", "delete", "add"]))
            if action == "replace":
                parent[path[-1]] = data.draw(VALUES)
            elif action == "delete" and isinstance(parent, dict):
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[data.draw(st.text(min_size=1, max_size=6))] = data.draw(VALUES)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed this path
    try:
        m = Manifest.from_json(json.dumps(doc))
    except ManifestError:
        return
    assert isinstance(m, Manifest)
