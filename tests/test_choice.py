"""Choice, a plan's option as a value: its text read and written in one place (NOTE [Choices
as values]), and plans that keep the text round-tripping through JSON with it checked."""

from __future__ import annotations

import json
import re

import pytest

import remat
from remat.planner import Choice, Decision, Plan

TEXTS = {
    "keep": Choice("keep"),
    "recompute": Choice("recompute"),
    "selective": Choice("selective"),
    "output": Choice("output"),
    "children:attn": Choice("children", ("attn",)),
    "children:fc+gelu": Choice("children", ("fc", "gelu")),
    "ops:aten::mm#0": Choice("ops", ("aten::mm#0",)),
    "ops:aten::mm#0+aten::addmm#3": Choice("ops", ("aten::mm#0", "aten::addmm#3")),
    "ops:": Choice("ops"),
    "head=recompute": Choice("recompute", module="head"),
    "layers.9.norm=output": Choice("output", module="layers.9.norm"),
}


@pytest.mark.parametrize("text", list(TEXTS))
def test_every_family_reads_and_prints_as_its_text(text):
    choice = Choice.parse(text)
    assert choice == TEXTS[text]
    assert str(choice) == text
    assert Choice.parse(str(choice)) == choice
    assert hash(choice) == hash(TEXTS[text])


def test_the_parts_read_by_family():
    assert Choice.parse("children:fc+gelu").children == ("fc", "gelu")
    assert Choice.parse("children:fc+gelu").calls == ()
    assert Choice.parse("ops:aten::mm#0+aten::bmm#1").calls == ("aten::mm#0", "aten::bmm#1")
    assert Choice.parse("ops:aten::mm#0").children == ()
    assert Choice.parse("selective").parts == ()
    assert Choice.parse("head=output").without_module() == Choice("output")
    assert Choice("children", ["a", "b"]).parts == ("a", "b")  # a list given: a tuple kept


@pytest.mark.parametrize("text", ["offload", "children", "ops", "children:", "children:a++b", "keep:x",
                                  "children:a+a", "=recompute", "head=children:a", "", "KEEP"])
def test_a_bad_text_is_refused_naming_it_and_the_forms(text):
    with pytest.raises(ValueError) as err:
        Choice.parse(text)
    message = str(err.value)
    assert message.startswith(f"remat.planner.Choice.parse: unknown option {text!r}")
    assert "choose from ('keep', 'recompute', 'selective', 'output'), 'children:<child>+<child>', " \
           "'ops:<operator>#<call>+...' ('ops:aten::mm#0') or 'staged:<operator>#<call>+...'" in message


@pytest.mark.parametrize("text", ["ops:mm#0", "ops:aten::mm", "ops:aten::mm#x", "ops:aten::mm#0+"])
def test_an_operator_option_with_a_bad_call_key_is_refused_naming_the_key(text):
    bad = text[4:].split("+")[-1]
    with pytest.raises(ValueError, match=rf"^remat.planner.Choice.parse: option {re.escape(repr(text))}: "
                                         rf"a call key looks like 'aten::mm#0' .*got {bad!r}$"):
        Choice.parse(text)
    with pytest.raises(ValueError, match=r"call key is repeated"):
        Choice.parse("ops:aten::mm#0+aten::mm#0")


def test_the_error_names_the_api_and_the_block_it_is_given():
    with pytest.raises(ValueError, match=r"^remat.plan: unknown option 'offload' for block 'b'; choose from"):
        Choice.parse("offload", api="remat.plan", block="b")
    with pytest.raises(ValueError, match=r"^remat.plan: option 'ops:mm#0' of block 'b': a call key"):
        Choice.parse("ops:mm#0", api="remat.plan", block="b")
    with pytest.raises(ValueError, match="not text"):
        Choice.parse(3)


def test_a_value_that_is_no_option_is_refused_when_made():
    for family, parts, module in [("offload", (), ""), ("keep", ("x",), ""), ("children", (), ""),
                                  ("ops", ("x",), ""), ("children", ("a",), "head")]:
        with pytest.raises(ValueError, match=r"^remat.planner.Choice: not an option"):
            Choice(family, parts, module)


def _plan(*choices: str) -> Plan:
    decisions = tuple(Decision(f"blocks.{i}", "Block", c, 1024.0 * (i + 1), 0.001 * i)
                      for i, c in enumerate(choices))
    return Plan(decisions=decisions, budget_bytes=10_000, predicted_peak_bytes=9_000,
                predicted_extra_s=0.01, step_s=0.1, no_recompute_peak_bytes=12_000,
                floor_bytes=4_000, solver="dynamic program")


def test_a_plan_of_every_family_round_trips_through_json():
    plan = _plan("keep", "recompute", "selective", "output", "children:attn+mlp",
                 "ops:aten::mm#0+aten::addmm#3")
    text = plan.to_json()
    assert Plan.from_json(text) == plan
    assert [d["choice"] for d in json.loads(text)["decisions"]] == list(plan.choices.values())
    assert [d.option for d in Plan.from_json(text).decisions] == [
        Choice("keep"), Choice("recompute"), Choice("selective"), Choice("output"),
        Choice("children", ("attn", "mlp")), Choice("ops", ("aten::mm#0", "aten::addmm#3"))]


def test_a_plan_written_before_choices_were_values_still_loads():
    written = {"remat_plan": 1, "decisions": [
        {"name": "h.0", "type": "Block", "choice": "children:attn", "kept_bytes": 10.0, "extra_s": 0.0},
        {"name": "h.1", "type": "Block", "choice": "ops:aten::addmm#1", "kept_bytes": 8.0, "extra_s": 0.1}],
        "budget_bytes": 100, "predicted_peak_bytes": 90, "predicted_extra_s": 0.1, "step_s": None,
        "no_recompute_peak_bytes": 120, "floor_bytes": 50}
    plan = Plan.from_json(json.dumps(written))
    assert plan.choices == {"h.0": "children:attn", "h.1": "ops:aten::addmm#1"}
    assert json.loads(plan.to_json())["decisions"] == written["decisions"]


@pytest.mark.parametrize("bad", ["children:", "offload", "ops:aten::mm", "head=recompute"])
def test_from_json_refuses_a_corrupted_option_naming_it(bad):
    data = json.loads(_plan("keep", "children:attn").to_json())
    data["decisions"][1]["choice"] = bad
    with pytest.raises(ValueError, match=rf"^remat.Plan.from_json: .*{bad!r}.*'blocks.1'"):
        Plan.from_json(json.dumps(data))


def test_a_decisions_option_is_its_choice_as_a_value():
    assert Decision("b", "Block", "output", 0.0, 0.0).option == Choice("output")
    bad = Decision("b", "Block", "offload", 0.0, 0.0)  # made freely, as Plan.apply's tests do
    with pytest.raises(ValueError, match=r"^remat.planner.Decision.option: unknown option 'offload' "
                                         r"for block 'b'"):
        _ = bad.option
    with pytest.raises(ValueError, match=r"names a module of its own; a block's option is 'recompute'"):
        _ = Decision("b", "Block", "head=recompute", 0.0, 0.0).option


def test_a_plan_made_by_remat_plan_round_trips_through_json():
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                    torch.nn.Linear(256, 64)) for _ in range(4)])
    plan = remat.plan(net, torch.randn(512, 64), budget=0.8, repeat=1)
    assert Plan.from_json(plan.to_json()) == plan
    assert all(str(d.option) == d.choice for d in plan.decisions)
