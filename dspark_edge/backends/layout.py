"""Where a decoder's K/V live: address arithmetic shared by every backend of the "append"
KV layout (the portable graph; see ``export.portable``).

One buffer per layer and K/V, sequence-major ``[capacity, kv_heads, head_dim]``. The committed
prefix (``length`` positions) is contiguous from the buffer's start, so a step binds ``past``
to the start with shape [1, length, kv_heads, head_dim] and the graph's new-K/V output to
``start + length * position_bytes`` with shape [1, width, kv_heads, head_dim]: the graph
appends in place and nothing is copied. Rolling back is forgetting a length.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BackendError


@dataclass(frozen=True)
class AppendLayout:
    capacity: int
    kv_heads: int
    head_dim: int
    itemsize: int  # bytes per element (4 for float32, 2 for float16)

    @property
    def position_bytes(self) -> int:
        return self.kv_heads * self.head_dim * self.itemsize

    @property
    def buffer_bytes(self) -> int:
        return self.capacity * self.position_bytes

    @property
    def buffer_shape(self) -> tuple[int, int, int, int]:
        return (1, self.capacity, self.kv_heads, self.head_dim)

    def past_shape(self, length: int) -> list[int]:
        return [1, length, self.kv_heads, self.head_dim]

    def new_shape(self, width: int) -> list[int]:
        return [1, width, self.kv_heads, self.head_dim]

    def new_offset(self, length: int) -> int:
        """Byte offset in a buffer where the K/V of position ``length`` go."""
        return length * self.position_bytes

    def check(self, length: int, width: int) -> None:
        if width < 1 or length < 0 or length + width > self.capacity:
            raise BackendError(f"cannot run {width} new tokens after {length} of {self.capacity} "
                               "KV positions: the context is full (raise max_context when loading)")
