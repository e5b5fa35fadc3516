"""Parameters on the chip: marking a pytree's arrays as device-resident, and their crossbar copies.

`program(params, chip)` moves a parameter pytree onto the chip: every array
leaf becomes a `Weight` (a pytree node whose one child is the array, so
`jax.grad`, `jax.tree.map` and optimisers see plain arrays). The weights are
*marked*, not guessed: only a marked array can be a crossbar operand. A marked
2-D matrix used by `dot_general`, or a kernel used by `conv_general_dilated`,
is programmed onto crossbar tiles (a `sidra_core.Resident`) the first time a
`sidra_jax.jit` function uses it, in the order the function uses them (as
sidra_torch does), or at once with `program(..., eager=True)`.

Each marked array has one `WeightSlot`: its name (the pytree path), its current
value and version, and its crossbar copies, one per way it is presented to the
crossbar (K x N as is or transposed, a conv kernel's layout and groups). A new
array in the same position (an optimizer step: `jax.tree.map` keeps the slots)
bumps the version; the next use reprograms the changed cells by ISPP
(`Chip.reprogram`), as sidra_torch does when a tensor's version counter moves.
"""

from __future__ import annotations

import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

import sidra_core
from sidra_core import Chip, conv_weight_matrix
from sidra_core.registry import WeightCopies

PARAM = "param"  # may be programmed onto crossbars
DATA = "data"  # device memory only (inputs put on the device with device_put)


class ViewOp:
    """One view-like primitive applied to a weight on its way to the crossbar (transpose, cast, reshape)."""

    __slots__ = ("prim", "params", "_key")

    def __init__(self, prim, params):
        self.prim = prim
        self.params = dict(params)
        self._key = (prim.name, repr(sorted(self.params.items())))

    def apply(self, v):
        return self.prim.bind(v, **self.params)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, ViewOp) and self._key == other._key

    def __repr__(self):
        return self._key[0]


class WeightSlot:
    """A device-resident array: name, current value and version, crossbar copies (Residents).

    Args:
        chip: The chip it lives on.
        value: Its array.
        name: Its name (the pytree path).
        kind: "param" (may be programmed onto crossbars) or "data" (device memory only).
    """

    def __init__(self, chip: Chip, value, name: str, kind: str = PARAM):
        self.chip = chip
        self.name = name
        self.kind = kind
        self.value = value
        self.version = 0
        self.copies = WeightCopies()  # its crossbar copies by resident key (freed with the slot)
        self._host = None  # (version, float32 numpy copy)
        self._lock = threading.RLock()

    def __repr__(self):
        return (f"WeightSlot({self.name!r}, {tuple(np.shape(self.value))}, v{self.version}, "
                f"{len(self.copies)} on crossbars)")

    def observe(self, value) -> None:
        """A concrete array arrived in this slot's position: a new one is a new version."""
        if value is self.value:
            return
        with self._lock:
            if value is self.value:
                return
            same = np.shape(value) == np.shape(self.value) and bool(np.array_equal(np.asarray(value), self.host()))
            self.value = value
            if not same:
                self.version += 1
                self._host = None

    def host(self) -> np.ndarray:
        h = self._host
        if h is None or h[0] != self.version:
            h = self._host = (self.version, np.asarray(self.value))
        return h[1]

    def matrix(self, key) -> np.ndarray:
        """The K x N matrix the crossbar holds for resident key `key` (see `layout_matrix`)."""
        return layout_matrix(self.host(), key)

    def resident(self, key, chip: Chip | None = None) -> sidra_core.Resident:
        """The crossbar copy for `key` on `chip` (default: its own), programmed (or incrementally
        reprogrammed) if needed."""
        with self._lock:
            return self.copies.get(chip or self.chip, key, self.version, lambda: self.matrix(key), name=self.name)[0]

    def fresh(self, key, chip: Chip | None = None) -> sidra_core.Resident | None:
        """The crossbar copy for `key` on `chip` (default: its own) if it is programmed and up to date, else None."""
        return self.copies.fresh(chip or self.chip, key, self.version)

    def held(self, key, chip: Chip | None = None) -> bool:
        """Whether `chip` (default: its own) holds a copy for `key` (current or not: its tiles are allocated)."""
        return self.copies.held(chip or self.chip, key)

    def free(self) -> None:
        """Release this weight's crossbar tiles."""
        self.copies.free()


def layout_matrix(value, key) -> np.ndarray:
    """The K x N matrix a crossbar holds for an array presented as resident key `key` (its view
    chain applied, then laid out by `dot_key`, `dot_nd_key` or `conv_key`)."""
    chain, kind = key[0], key[1]
    v = value
    if chain:
        v = jnp.asarray(v)
        for op in chain:
            v = op.apply(v)
    v = np.asarray(v, np.float32)
    if kind == "dot":
        return np.ascontiguousarray(v if key[2] == 0 else v.T)
    if kind == "dot_nd":  # contracted dims (in the matmul's order) flattened into K, the others into N
        contracting, free = key[2], key[3]
        return np.ascontiguousarray(np.transpose(v, contracting + free).reshape(
            math.prod(v.shape[d] for d in contracting), -1))
    if kind == "conv":
        _, _, rhs_spec, groups = key
        return conv_weight_matrix(np.transpose(v, rhs_spec), groups)
    raise ValueError(f"unknown crossbar layout {kind!r}")


def dot_key(chain: tuple, contracting_dim: int) -> tuple:
    """Resident key of a 2-D weight used by a matmul that contracts its dimension `contracting_dim`."""
    return (tuple(chain), "dot", int(contracting_dim))


def dot_nd_key(chain: tuple, contracting: tuple, free: tuple) -> tuple:
    """Resident key of an N-d weight (Flax DenseGeneral's kernels) contracted on dims `contracting`:
    held as a (prod contracted) x (prod free) matrix."""
    return (tuple(chain), "dot_nd", tuple(int(d) for d in contracting), tuple(int(d) for d in free))


def conv_key(chain: tuple, rhs_spec: tuple, groups: int) -> tuple:
    """Resident key of a conv kernel with layout `rhs_spec` (out, in, spatial... dims) and groups."""
    return (tuple(chain), "conv", tuple(int(d) for d in rhs_spec), int(groups))


def kernel_spec(layout: str) -> tuple:
    """rhs_spec of a kernel layout string such as "HWIO" (Flax) or "OIHW" (PyTorch)."""
    layout = layout.upper()
    if "O" not in layout or "I" not in layout:
        raise ValueError(f"a kernel layout names its O and I dimensions, got {layout!r}")
    return (layout.index("O"), layout.index("I"), *[i for i, c in enumerate(layout) if c not in "OI"])


@jax.tree_util.register_pytree_with_keys_class
class Weight:
    """A device-resident array in a pytree: the array is the node's only child, the slot its static data.

    Args:
        value: The array.
        slot: Its WeightSlot (name, version, crossbar copies).
    """

    __slots__ = ("value", "slot")

    def __init__(self, value, slot: WeightSlot):
        self.value = value
        self.slot = slot

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("value"), self.value),), self.slot

    def tree_flatten(self):
        return (self.value,), self.slot

    @classmethod
    def tree_unflatten(cls, slot, children):
        return cls(children[0], slot)

    @property
    def shape(self):
        return np.shape(self.value)

    @property
    def dtype(self):
        return jnp.result_type(self.value)

    def __repr__(self):
        return f"Weight({self.slot.name!r}, shape={tuple(self.shape)}, chip={self.slot.chip.spec.name})"


def is_weight(x) -> bool:
    """Whether x is a device-resident Weight (the `is_leaf` of pytree walks over programmed params).

    Args:
        x: Any pytree node.

    Returns:
        True for a Weight.
    """
    return isinstance(x, Weight)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _charge_transfer(chip: Chip, value) -> None:
    chip.charge_host(int(np.size(value)) * np.dtype(jnp.result_type(value)).itemsize)


def program(params, chip: Chip, *, eager: bool = False, conv_layout: str = "HWIO", prefix: str = ""):
    """Move a parameter pytree onto `chip`: every array leaf becomes a `Weight`.

    Each array crosses the host link once (charged, as `Module.to("sidra")` is).
    With `eager=False` (default) crossbar programming happens at first use
    inside `sidra_jax.jit`, in the function's order: the same order, seeds and
    tiles as sidra_torch's lazy programming. With `eager=True`, 2-D float
    leaves are programmed now as K x N (x @ W) and higher-rank float leaves as
    conv kernels of layout `conv_layout` ("HWIO" for Flax, "OIHW" for
    PyTorch-style), in pytree order.

    A pytree that already holds Weights on this chip keeps their slots (a
    changed array is a new version, reprogrammed at its next use).

    Args:
        params: The parameter pytree.
        chip: The chip.
        eager: Program the crossbar copies now rather than at first use.
        conv_layout: The kernel layout of higher-rank leaves, for `eager`.
        prefix: Prepended to each weight's name (its pytree path).

    Returns:
        The pytree with every array leaf a Weight.

    Raises:
        TypeError: `chip` is not a sidra_core.Chip.
        ValueError: A Weight of the pytree lives on another chip.
    """
    if not isinstance(chip, Chip):
        raise TypeError(f"program() needs a sidra_core.Chip, got {type(chip).__name__}")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_weight)
    out = []
    for path, leaf in flat:
        if isinstance(leaf, Weight):
            if leaf.slot.chip is not chip:
                raise ValueError(f"{leaf.slot.name} is on another chip; bring it back to the host first (unprogram)")
            if not isinstance(leaf.value, jax.core.Tracer):
                leaf.slot.observe(leaf.value)
            out.append(leaf)
            continue
        if not _is_array(leaf):
            out.append(leaf)
            continue
        value = jnp.asarray(leaf)
        _charge_transfer(chip, value)
        out.append(Weight(value, WeightSlot(chip, value, prefix + jax.tree_util.keystr(path))))
    result = jax.tree_util.tree_unflatten(treedef, out)
    if eager:
        spec = kernel_spec(conv_layout)
        for w in jax.tree_util.tree_leaves(result, is_leaf=is_weight):
            if not isinstance(w, Weight) or not jnp.issubdtype(w.dtype, jnp.floating):
                continue
            if len(w.shape) == 2:
                w.slot.resident(dot_key((), 0))
            elif len(w.shape) >= 3 and len(w.shape) == len(spec):
                w.slot.resident(conv_key((), spec, 1))
    return result


def device_put(x, chip: Chip):
    """Put an input pytree in device memory (charged once): a sidra_jax.jit call then skips its transfer.

    Unlike `program`, these arrays are data, never crossbar weights.

    Args:
        x: The input pytree.
        chip: The chip.

    Returns:
        The pytree with every array leaf a data Weight.
    """
    def put(path, leaf):
        if not _is_array(leaf):
            return leaf
        value = jnp.asarray(leaf)
        _charge_transfer(chip, value)
        return Weight(value, WeightSlot(chip, value, "data" + jax.tree_util.keystr(path), kind=DATA))

    return jax.tree_util.tree_map_with_path(put, x)


def unprogram(params):
    """The plain arrays of a programmed pytree (the crossbar copies stay until the slots are freed).

    Args:
        params: A pytree holding Weights.

    Returns:
        The pytree with each Weight replaced by its array.
    """
    return jax.tree_util.tree_map(lambda w: w.value if isinstance(w, Weight) else w, params, is_leaf=is_weight)


def free(params) -> None:
    """Release every crossbar tile held by a programmed pytree.

    Args:
        params: A pytree holding Weights.

    Returns:
        None.
    """
    for w in jax.tree_util.tree_leaves(params, is_leaf=is_weight):
        if isinstance(w, Weight):
            w.slot.free()


def residents(params) -> list:
    """(name, Resident) for every crossbar copy of a programmed pytree.

    Args:
        params: A pytree holding Weights.

    Returns:
        A list of (weight name, Resident) pairs.
    """
    out = []
    for w in jax.tree_util.tree_leaves(params, is_leaf=is_weight):
        if isinstance(w, Weight):
            out += [(w.slot.name, r) for r in w.slot.copies.residents()]
    return out
