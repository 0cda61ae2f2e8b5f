"""Drafter thread settings raced against plain decoding (interleaved, 4 prompts, 96 tokens):
the DSpark drafter with 1 thread (FP32, INT8) or 2 threads without spinning, target spinning on.

    python bench/drafter_threads.py
"""
import dspark_edge
from dspark_edge.backends import BackendOptions
from dspark_edge.drafters.dspark import DSparkDrafter
from dspark_edge.bench import load_prompts
eng = "engines/smollm2-135m"
prompts = load_prompts()[:4]
m = dspark_edge.read_manifest(eng)
variants = {}
base = dspark_edge.load(eng, "fp32")  # spinning on
d1 = DSparkDrafter(eng, m, "fp32", options=BackendOptions(intra_op_threads=1, allow_spinning=False))
d1i8 = DSparkDrafter(eng, m, "int8", options=BackendOptions(intra_op_threads=1, allow_spinning=False))
d2 = DSparkDrafter(eng, m, "fp32", options=BackendOptions(allow_spinning=False))
res = {}
for rec in prompts:
    for name, dr, k in [("plain", None, None), ("1thr k1", d1, 1), ("1thr-int8 k1", d1i8, 1), ("2thr-nospin k1", d2, 1), ("1thr k3", d1, 3)]:
        base.drafter = dr
        kw = {} if k is None else {"draft_tokens": k}
        r = base.generate(rec["messages"], max_new_tokens=96, ignore_eos=True, **kw)
        s = r.stats
        res.setdefault(name, []).append((s.new_tokens - 1, s.decode_s, s.draft_s, s.rounds, s.draft_n_accepted))
for n, v in res.items():
    t = sum(x[0] for x in v); d = sum(x[1] for x in v); ds = sum(x[2] for x in v); r = sum(x[3] for x in v); a = sum(x[4] for x in v)
    print(f"{n}: {t/d:.1f} tok/s, draft ms/round {ds/r*1e3:.1f}, tau {(a+r)/r:.2f}")
