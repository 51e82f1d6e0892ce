"""Differential fuzzing: random small models x random marks, bitwise against the unmarked model.

Each case (tests/fuzz_models.py) builds a model twice from one seed, marks the second
copy, and runs both in lockstep: two optimizer steps (SGD or AdamW), sometimes
``backward(retain_graph=True)`` twice, ``torch.autograd.grad`` and a gradient penalty
(``create_graph=True``). Loss, outputs, every gradient, parameter and buffer must be
equal (``torch.equal``). A case may instead end in a typed error the README documents
(``fuzz_models.DOCUMENTED_ERRORS``), with the parameters untouched and no engine state
left behind. ``fuzz_models.KNOWN_BROKEN`` excuses named classes of failure
while their fix is pending; every other failure fails the test.

``REMAT_FUZZ_CASES=5000`` runs more eager cases (default 1200), ``REMAT_FUZZ_COMPILED=20``
more ``remat.compile`` cases (default 3); ``REMAT_FUZZ_REPORT=fuzz.jsonl`` writes every
eager case's verdict and class. Reproduce one case with
``PYTHONPATH=src python -m tests.fuzz_models SEED --show [--shrink] [--compile]``.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import os
import warnings

import pytest
import torch

import remat
from remat._engine.dead import skipped_calls
from tests import fuzz_models as fm

EAGER_CASES = int(os.environ.get("REMAT_FUZZ_CASES", "1200"))
COMPILED_CASES = int(os.environ.get("REMAT_FUZZ_COMPILED", "3"))
FAILURES = ("mismatch", "crash", "leak")


def _run(cases: list[fm.Case]) -> list[fm.Result]:
    results = []
    for case in cases:
        result = fm.run_case(case)
        if result.verdict in FAILURES:
            result.known = fm.known_broken(case, result)
        results.append(result)
    return results


def _summary(results: list[fm.Result]) -> str:
    verdicts = collections.Counter(r.verdict for r in results)
    known = collections.Counter((r.known, r.verdict) for r in results if r.known is not None)
    tolerated = [r for r in results if r.tolerated]
    lines = [f"{len(results)} cases: " + ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items())),
             (f"reentrant tolerance needed in {len(tolerated)} cases "
              f"({sum(r.tolerated for r in tolerated)} comparisons)")]
    lines += [f"  known broken, class {c}: {n} {v}" for (c, v), n in sorted(known.items())]
    return "\n".join(lines)


def _unexplained(results: list[fm.Result], flag: str = "") -> list[str]:
    return [f"case {r.seed}: {r.verdict}: {r.detail}\n    reproduce: PYTHONPATH=src python -m "
            f"tests.fuzz_models {r.seed} --show --shrink{flag}"
            for r in results if r.verdict in FAILURES and r.known is None]


def _write_report(results: list[fm.Result]) -> None:
    """With ``REMAT_FUZZ_REPORT=path``, write one JSON line per case (seed, verdict, class, detail)."""
    path = os.environ.get("REMAT_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            f.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in results)


def test_fuzz_eager_marks_change_no_number():
    skipped = skipped_calls()
    results = _run([fm.make_case(seed) for seed in range(EAGER_CASES)])
    if EAGER_CASES >= 300:  # the policies of `fm.CUT_POLICIES` leave calls dead in re-runs
        assert skipped_calls() > skipped, "no case's re-run skipped a dead call"
    _write_report(results)
    summary = _summary(results)
    print("\n" + summary)
    bad = _unexplained(results)
    assert not bad, summary + "\n" + "\n".join(bad)
    used = {c for r in results if r.known for c in r.known.split("+")}
    unused = [number for number, _, _ in fm.KNOWN_BROKEN if number not in used]
    if unused:  # rare classes may just not have come up; a fixed class's entry should go
        warnings.warn(f"KNOWN_BROKEN entries that excused no case in this run: {unused}; "
                      f"delete those whose fix has landed", stacklevel=1)
    compared = sum(r.verdict in ("ok", "documented") for r in results)
    assert compared >= min(500, EAGER_CASES // 2), summary  # the floor of combinations checked


def test_fuzz_compiled_marks_change_no_number():
    """``remat.compile`` of the marked model against ``remat.compile`` of the unmarked one."""
    seeds, seed = [], 100_000
    while len(seeds) < COMPILED_CASES:  # compiling is slow: spend it on cases valid in eager
        case = fm.make_case(seed)
        # torch.compile (aot_eager) itself fails on some unmarked models, with "view size is not
        # compatible": the "view" wire, and a Linear after a transposed BatchNorm1d
        blocks = [b for stage in case.desc["stages"] for b in stage]
        rejected = any(b["wire"] == "view" or b["p"].get("batch") for b in blocks)
        if not rejected and fm.run_case(case).verdict == "ok":
            seeds.append(seed)
        seed += 1
    results = _run([fm.make_case(seed, compiled=True) for seed in seeds])
    summary = _summary(results)
    print("\n" + summary)
    for r in results:
        r.known = None  # graph mode has no known-broken class: every failure counts
    bad = _unexplained(results, " --compile")
    assert not bad, summary + "\n" + "\n".join(bad)
    assert sum(r.verdict == "ok" for r in results) >= 1, summary


def test_cases_are_reproducible_from_their_seed():
    a, b = fm.make_case(123), fm.make_case(123)
    assert a.show() == b.show()
    ma, mb = fm.build(a.desc), fm.build(b.desc)
    assert all(torch.equal(p, q) for p, q in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True))
    assert fm.run_case(a).verdict == fm.run_case(b).verdict
    assert len({fm.make_case(s).show() for s in range(20)}) == 20


def test_generator_covers_every_block_wire_and_mark_kind():
    seen_blocks, seen_wires, seen_marks, seen_calls = set(), set(), set(), set()
    seen_policies = set()
    for seed in range(600):
        case = fm.make_case(seed)
        for m in case.plan:
            opts = m.get("call", m).get("opts", {})
            seen_policies |= {opts[k] for k in ("policy", "context") if k in opts}
        for stage in case.desc["stages"]:
            seen_blocks |= {b["kind"] for b in stage}
            seen_wires |= {b["wire"] for b in stage}
        seen_marks |= {m["kind"] for m in case.plan}
        for m in case.plan:
            call = m.get("call", m) if m["kind"] in ("call", "marked_call") else None
            if call is not None:
                o = call["opts"]
                seen_calls.add((m["kind"], call["api"], o.get("form", "module"),
                                bool(o.get("use_reentrant")), o.get("early_stop", True)))
    assert seen_blocks == set(fm.BLOCKS)
    assert {fm.make_case(seed).change["kind"] for seed in range(600) if fm.make_case(seed).change} == set(fm.CHANGES)
    assert sum(fm.make_case(seed).freeze_before_backward is not None for seed in range(600)) >= 20
    assert sum(fm.make_case(seed).fast_weights for seed in range(600)) >= 20
    assert any(fm.make_case(seed).desc.get("leaf_view") for seed in range(600))  # a view of a parameter returned
    staged = {m.get("mark", m)["opts"].get("stages") for seed in range(600) for m in fm.make_case(seed).plan
              if "opts" in m.get("mark", m)}
    assert {2, 3, "each"} <= staged  # NOTE [Re-runs in stages], NOTE [Each saved tensor rebuilt on its own]
    assert seen_wires == set(fm.WIRES)
    assert seen_marks == set(fm.MARKS)
    assert seen_policies >= set(fm.POLICIES) | set(fm.CONTEXTS)
    # a region over a marked block, in every form, both implementations, without early stop
    over_marked = {c[2:] for c in seen_calls if c[0] == "marked_call" and c[1] == "checkpoint"}
    assert {(form, reentrant) for form, reentrant, _ in over_marked} == {
        (form, reentrant) for form in fm.FORMS for reentrant in (False, True)}
    assert any(not early_stop for _, _, early_stop in over_marked)
    # forwards under a user's saved-tensor hook (the region saves through it), and not
    outer = [fm.make_case(seed).outer_hooks for seed in range(100)]
    assert any(outer) and not all(outer)
    # cases whose policies leave products dead in the re-run (NOTE [Dead operators in a
    # selective re-run]), each of them
    assert {fm.make_case(seed).cut for seed in range(100)} == {None, *fm.CUT_POLICIES}


# --- the harness itself must catch what it claims to catch -----------------------------


def _plain_case() -> fm.Case:
    desc = {"seed": 7, "stages": [[{"kind": "mlp", "p": {"act": "gelu"}, "wire": "none"}]],
            "tie": [], "frozen": []}
    return fm.Case(7, desc, [{"kind": "cell", "path": "stages.0.blocks.0", "opts": {}}])


def test_harness_passes_a_correct_mark():
    assert fm.run_case(_plain_case()).verdict == "ok"


def test_harness_reports_a_gradient_wrong_in_the_last_bit(monkeypatch):
    def nudge(model, mark):  # a "mark" that changes the gradient into one block by one ulp
        def hook(module, args, out):
            out.register_hook(lambda g: g * (1 + torch.finfo(g.dtype).eps))

        model.get_submodule(mark["path"]).register_forward_hook(hook)

    monkeypatch.setitem(fm.MARKS, "nudge", fm.MarkKind(0.0, lambda r, m: None, nudge))
    case = _plain_case()
    case.plan = [{"kind": "nudge", "path": "stages.0.blocks.0"}]
    result = fm.run_case(case)
    assert result.verdict == "mismatch" and "grad" in result.detail
    case.plan.insert(0, {"kind": "cell", "path": "stages.0.blocks.0", "opts": {"use_reentrant": True}})
    result = fm.run_case(case)
    assert result.tolerated > 0  # the reentrant tolerance, and only there
    assert result.verdict == "ok", result.detail


@pytest.mark.parametrize("kind", ["new_parameters", "parameter_to_buffer"])
def test_harness_reports_facts_trusted_after_the_model_changed(monkeypatch, kind):
    """The door of a model changed between steps: an engine that trusted what it learned of a
    region's modules in the first step (its tree never walked again) trains the second step
    wrong, and the harness says so; the engine as it is re-observes and matches. New
    parameters read unseen are then caught by the re-run's graph walk (NOTE [Reads that
    vary]): a typed refusal in backward, never a silent wrong gradient."""
    from remat._engine import boundary

    case = _plain_case()
    case.plan = [{"kind": "cell", "path": "stages.0.blocks.0", "opts": {"use_reentrant": True}}]
    case.change = {"kind": kind, "path": "stages.0.blocks.0.fc1"}
    assert fm.run_case(case).verdict == "ok"

    def stale(known):  # the modules' dictionaries as they are now, never compared
        modules = [ref() for ref in known.modules]
        return modules, boundary._dicts(modules)

    monkeypatch.setattr(boundary._Known, "current", stale)
    result = fm.run_case(case)
    if kind == "new_parameters":
        assert result.verdict == "documented" and "Reads that vary" in result.detail, result.detail
    else:
        assert result.verdict in ("mismatch", "crash"), result.detail


def test_harness_reports_a_leaked_hook(monkeypatch):
    def leak(model, mark):
        model.register_forward_hook(
            lambda *a: torch._C._autograd._push_saved_tensors_default_hooks(lambda x: x, lambda x: x))

    monkeypatch.setitem(fm.MARKS, "leak", fm.MarkKind(0.0, lambda r, m: None, leak))
    case = _plain_case()
    case.plan = [{"kind": "leak"}]
    assert fm.run_case(case).verdict in ("leak", "crash")
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # cleaned up


def test_harness_accepts_documented_errors_only():
    case = copy.deepcopy(_plain_case())
    case.desc["stages"][0][0] = {"kind": "keywords", "p": {"scale": 2.0, "mode": "plain", "gate": True},
                                 "wire": "none"}
    case.plan = [{"kind": "call", "api": "checkpoint", "path": "stages.0.blocks.0",
                  "opts": {"use_reentrant": True}}]
    result = fm.run_case(case)
    assert result.verdict == "documented", result.detail  # torch's "Unexpected keyword arguments"
    assert fm._documented(RuntimeError("anything else")) is None
    assert fm._documented(remat.RecomputeError("remat: region 'f' ... different metadata")) is None
