"""Selective recompute policies: which operator outputs a region keeps (layer 1).

A policy is a small frozen value that answers one question for each operator a
region runs: *save* its output (keep it for backward) or *recompute* it. Policies
look at the operator's name (``"aten::mm"``, ``"aten::relu"``), and a per-call
policy (`save_calls`) also at the call's place among the region's calls of
that name (``"aten::mm#1"``: its second matrix product), so this module imports no
torch and a policy can be printed, hashed, compared and read back from its name.

NOTE [Counting calls]
A call key ``"aten::mm#k"`` names the ``k``-th call (from 0) of ``aten::mm``, any
overload, among the calls one run of the region makes that a policy may keep: not
views, not in-place or ``out=`` operators (they are always re-run). The eager engine
counts them as the region's forward dispatches them and again, in the same order,
in recomputation; the graph pass counts the region's forward nodes of that name in
graph order (Dynamo and AOTAutograd trace them in the order they run). The two counts
agree for every operator that has no in-place form in the region's code (matrix
products, convolutions, attention: the calls a plan keys); functionalization turns an
in-place ``add_`` into an ``add`` the graph counts and the eager engine does not.

Examples:
    >>> from remat import save_compute_intensive
    >>> save_compute_intensive.saves("aten::mm"), save_compute_intensive.saves("aten::relu")
    (True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Operators whose outputs are expensive to rebuild: matrix products, convolutions, attention.
COMPUTE_INTENSIVE_OPS: frozenset[str] = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::matmul",
        "aten::linear",
        "aten::_scaled_mm",
        "aten::convolution",
        "aten::_convolution",
        "aten::cudnn_convolution",
        "aten::mkldnn_convolution",
        "aten::convolution_overrideable",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
    }
)


def op_base_name(name: str) -> str:
    """Strip the overload: ``"aten::add.Tensor"`` -> ``"aten::add"``."""
    return name.split(".", 1)[0]


@dataclass(frozen=True)
class Policy:
    """Decide per operator whether a region keeps its output.

    Args:
        name: how the policy prints.
        save_ops: operator names (without overload) whose outputs are kept.
        save_everything: keep every operator's output (nothing is recomputed).

    Examples:
        >>> from remat import Policy
        >>> p = Policy("keep_matmuls", save_ops=frozenset({"aten::mm"}))
        >>> p.saves("aten::mm.default"), p.saves("aten::gelu")
        (True, False)
    """

    name: str
    save_ops: frozenset[str] = frozenset()
    save_everything: bool = False
    #: ``(operator name, call number)`` pairs whose outputs are kept (NOTE [Counting calls])
    save_calls: frozenset[tuple[str, int]] = frozenset()
    _called: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def saves(self, op_name: str) -> bool:
        """Return True when some call of operator ``op_name`` may be kept (all of them,
        unless the policy keys calls: then ask `saves_call`)."""
        base = op_base_name(op_name)
        return self.save_everything or base in self.save_ops or base in self._called

    def saves_call(self, op_name: str, index: int) -> bool:
        """Return True when call ``index`` (from 0, NOTE [Counting calls]) of ``op_name``
        is kept for backward."""
        base = op_base_name(op_name)
        return self.save_everything or base in self.save_ops or (base, index) in self.save_calls

    def __post_init__(self) -> None:
        called = frozenset(name for name, _ in self.save_calls)
        object.__setattr__(self, "_called", called)  # asked on every operator: computed once

    def __repr__(self) -> str:
        return self.name


def save_only(*op_names: str) -> Policy:
    """Return a policy that keeps the outputs of ``op_names`` and recomputes all else.

    Args:
        *op_names: aten operator names, e.g. ``"aten::mm"`` (an overload suffix is ignored).

    Returns:
        A `Policy`.

    Examples:
        >>> from remat import save_only
        >>> save_only("aten::mm", "aten::convolution")
        save_only('aten::mm', 'aten::convolution')
    """
    names = tuple(op_base_name(n) for n in op_names)
    bad = [n for n in names if "::" not in n]
    if bad:
        raise ValueError(
            f"remat.save_only: operator names must look like 'aten::mm', got {bad!r}"
        )
    shown = ", ".join(repr(n) for n in names)
    return Policy(f"save_only({shown})", save_ops=frozenset(names))


def call_key(op_name: str, index: int) -> str:
    """The key of call ``index`` of ``op_name``: ``call_key("aten::mm", 1) == "aten::mm#1"``."""
    return f"{op_base_name(op_name)}#{index}"


def parse_call_key(key: str, api: str = "remat.save_calls") -> tuple[str, int]:
    """``"aten::mm#1"`` -> ``("aten::mm", 1)``; a malformed key raises ``ValueError``."""
    name, sep, number = str(key).rpartition("#")
    if not sep or "::" not in name or not number.isdigit():
        raise ValueError(
            f"{api}: a call key looks like 'aten::mm#0' (operator name, '#', the call's "
            f"number among the region's calls of that operator, from 0), got {key!r}"
        )
    return op_base_name(name), int(number)


def save_calls(*keys: str) -> Policy:
    """Return a policy that keeps the outputs of the operator calls ``keys`` and
    recomputes all else: the per-operator choices of `remat.plan`.

    Args:
        *keys: call keys ``"aten::mm#1"``: the second ``aten::mm`` call of the region
            (NOTE [Counting calls]); any order, each once.

    Returns:
        A `Policy` whose name lists the keys in order (``Policy.name`` reads back
        through `policy_from_name`).

    Raises:
        ValueError: a malformed or repeated key.

    Examples:
        >>> from remat import save_calls
        >>> p = save_calls("aten::mm#1", "aten::addmm#0")
        >>> p, p.saves_call("aten::mm", 1), p.saves_call("aten::mm", 0)
        (save_calls('aten::addmm#0', 'aten::mm#1'), True, False)
    """
    parsed = [parse_call_key(k) for k in keys]
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"remat.save_calls: a call key is repeated in {list(keys)!r}")
    ordered = sorted(parsed)
    shown = ", ".join(repr(call_key(n, i)) for n, i in ordered)
    return Policy(f"save_calls({shown})", save_calls=frozenset(ordered))


def policy_from_name(name: str) -> Policy:
    """The policy a name printed by a policy stands for (a plan's JSON holds names).

    Examples:
        >>> from remat._vocab.policy import policy_from_name, save_calls
        >>> policy_from_name(repr(save_calls("aten::mm#2"))) == save_calls("aten::mm#2")
        True
    """
    for known in (save_all, recompute_all, save_compute_intensive):
        if name == known.name:
            return known
    for prefix, make in (("save_calls(", save_calls), ("save_only(", save_only)):
        if name.startswith(prefix) and name.endswith(")"):
            inner = name[len(prefix):-1]
            items = [item.strip().strip("'\"") for item in inner.split(",") if item.strip()]
            return make(*items)
    raise ValueError(f"remat policy: no policy is named {name!r}; names read back are "
                     f"save_all, recompute_all, save_compute_intensive, save_only(...), save_calls(...)")


save_all = Policy("save_all", save_everything=True)
"""Keep every operator's output: the region behaves as if unmarked (a baseline)."""
recompute_all = Policy("recompute_all")
"""Keep nothing inside the region: every saved tensor is rebuilt (plain recompute)."""
save_compute_intensive = Policy("save_compute_intensive", save_ops=COMPUTE_INTENSIVE_OPS)
"""Keep the outputs of matmuls, convolutions and attention; recompute pointwise operators."""
