"""The supervisor's rule table: each rule matches its texts and none of its look-alikes."""

import pytest
from shoal.contract.termination import Cause, is_permanent
from shoal.supervisor import rules


@pytest.mark.parametrize("rule", rules.RULES, ids=lambda r: r.pattern.pattern[:40])
def test_each_rule_matches_its_fault_and_not_its_look_alikes(rule):
    assert rule.matches, "a rule without texts it must match is untested"
    for text in rule.matches:
        assert rule.pattern.search(text), text
        assert rules.classify([text]) == rule.cause, text
    for text in rule.must_not_match:
        assert not rule.pattern.search(text), text


def test_permanent_rules_are_only_configuration_and_a_missing_model():
    permanent = {r.cause for r in rules.RULES if is_permanent(r.cause)}
    assert permanent == {Cause.CONFIG_ERROR, Cause.MODEL_NOT_FOUND}


@pytest.mark.parametrize("text", [
    "RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {}",
    "RuntimeError: Worker failed with error 'InvalidCxxCompiler: No working C++ compiler found',"
    " please check the stack trace above for the root cause",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
])
def test_what_is_not_a_known_fault_stays_unclassified(text):
    assert rules.classify([text]) is None
