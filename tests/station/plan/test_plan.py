"""The decode plan on tiny random models, in process: which forward body, decode steps,
linear forms and head each runs with on this CPU, and every refused candidate's reason."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import pytest

from gnosis_daemon.settings import Settings
from station.model.loader import LoadedModel, load_model
from station.plan import choose
from station.plan.choose import Body, Entry, choose_plan
from station.plan.plan import DecodePlan, GraphShape
from tests.support.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("few_threads")

HEAD_APPLIED = "the logits are exactly lm_head(hidden): the runner applies the head"
FLOATS_KEPT = "weights=auto keeps a float checkpoint's floats"
NOT_FULL = "not every layer attends causally to its whole context (windows, soft-capping or sinks)"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-models")
    return {family: build_tiny_model(root / family, family) for family in ("llama", "qwen2", "gemma2")}


def planned(path: Path, tmp_path: Path, **overrides) -> tuple[DecodePlan, choose.DecodeParts, LoadedModel]:
    """A fresh load of ``path`` (the plan packs its layers) and its plan under ``overrides``."""
    settings = Settings(model=str(path), runtime_dir=str(tmp_path / "rt"), model_cache_dir=str(tmp_path),
                        **overrides)
    loaded = load_model(settings)
    plan, parts = choose_plan(loaded, settings)
    return plan, parts, loaded


def whys(plan: DecodePlan) -> dict[str, list[tuple[str, bool, str]]]:
    return {role: [(c.name, c.used, c.why) for c in choice.candidates] for role, choice in plan.parts().items()}


def test_a_float_llama_runs_the_lean_decoder_over_onednn_layers(models, tmp_path):
    plan, parts, _ = planned(models["llama"], tmp_path)
    assert plan.path() == {"forward": "lean", "decode_steps": "forward-body", "linears": ["onednn"],
                           "head": ["onednn"]}
    assert whys(plan) == {
        "forward": [("c-step", False, "no 4-bit decoder layers"),
                    ("lean", True, "the Llama-family layers' arithmetic in one loop"),
                    ("transformers", False, "not tried: lean comes first")],
        "decode_steps": [("cuda-graphs", False, "no CUDA device"),
                         ("static-step", False, "setting decode_graphs=auto: without CUDA only with on"),
                         ("forward-body", True, "every step through the lean body")],
        "linears": [("int4", False, FLOATS_KEPT), ("int8", False, FLOATS_KEPT),
                    ("onednn", True, "packed once for oneDNN"),
                    ("dense", False, "no decoder layer left in float")],
        "head": [("q8-kernel", False, "not a GGUF file"), ("onednn", True, "packed once for oneDNN"),
                 ("dense", False, "not needed: onednn runs"), ("model-forward", False, HEAD_APPLIED)]}
    assert [c.layers for c in plan.linears.candidates] == [0, 0, 14, 0]  # 2 layers of 7 linears
    assert plan.graphs is None and parts.graphs is None and parts.body.step is None
    assert parts.head is not None and parts.head.packed is not None and parts.head.kernel is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.forward = plan.head  # type: ignore[misc]
    shown = plan.as_dict()
    assert msgpack.unpackb(msgpack.packb(shown)) == shown  # what hello carries
    assert shown["candidates"]["forward"][0] == {"name": "c-step", "used": False,
                                                 "why": "no 4-bit decoder layers"}


def test_a_qwen2_model_runs_the_lean_decoder_too(models, tmp_path):
    plan, _, _ = planned(models["qwen2"], tmp_path, decode_graphs="on")
    assert plan.forward.chosen == "lean" and plan.forward.refused()["c-step"] == "no 4-bit decoder layers"
    # decode_graphs=on without CUDA: the static step, uncaptured, within the plan's bounds
    assert plan.decode_steps.chosen == "static-step"
    assert plan.decode_steps["static-step"].why == "steps of up to 32 rows and 4096 positions, uncaptured (no CUDA)"
    assert plan.graphs == GraphShape(max_rows=32, max_context=4096, capture=False)


def test_gemma2_runs_transformers_forward_and_its_own_head(models, tmp_path):
    """Sliding windows and soft-capped logits: no C step, no lean loop, the model's own head."""
    plan, parts, _ = planned(models["gemma2"], tmp_path, decode_graphs="on")
    post = "the model post-processes its logits (soft-capping or a scale)"
    assert plan.path() == {"forward": "transformers", "decode_steps": "forward-body", "linears": ["onednn"],
                           "head": ["model-forward"]}
    assert whys(plan)["forward"] == [("c-step", False, NOT_FULL), ("lean", False, "not a Llama-family model"),
                                     ("transformers", True, "the model's own forward")]
    assert whys(plan)["decode_steps"] == [
        ("cuda-graphs", False, "no CUDA device"),
        ("static-step", False, "the forward body is transformers, not the lean decoder"),
        ("forward-body", True, "every step through the transformers body")]
    assert whys(plan)["head"] == [("q8-kernel", False, post), ("onednn", False, post), ("dense", False, post),
                                  ("model-forward", True, "the model's own forward over the kept rows")]
    assert parts.head is None and plan.graphs is None


def test_int4_weights_with_the_c_step_on(models, tmp_path):
    plan, parts, loaded = planned(models["llama"], tmp_path, weights="int4", cpu_decode_step="on",
                                  decode_graphs="on")
    kernels = loaded.weights.step.kernels()  # the instructions this machine's build uses
    assert "4-bit products" in kernels and "prompts in calls of up to 64 rows" in kernels
    assert whys(plan)["forward"] == [("c-step", True, f"setting cpu_decode_step=on; {kernels}"),
                                     ("lean", False, "not tried: c-step comes first"),
                                     ("transformers", False, "not tried: c-step comes first")]
    assert plan.decode_steps.refused()["static-step"] == "the forward body is c-step, not the lean decoder"
    assert whys(plan)["linears"] == [("int4", True, "setting weights=int4"), ("int8", False, "setting weights=int4"),
                                     ("onednn", False, "no decoder layer left in float"),
                                     ("dense", False, "no decoder layer left in float")]
    assert plan.linears["int4"].layers == 14
    assert parts.body.step is loaded.weights.step and parts.body.decoder is None


def test_the_settings_refuse_what_they_turn_off(models, tmp_path):
    plan, _, _ = planned(models["llama"], tmp_path, lean_decoder=False, cpu_packed_linears=False,
                         cpu_decode_step="off", decode_graphs="off")
    assert plan.forward.refused() == {"c-step": "setting cpu_decode_step=off", "lean": "setting lean_decoder=off"}
    assert plan.decode_steps.refused() == {"cuda-graphs": "setting decode_graphs=off",
                                           "static-step": "setting decode_graphs=off: without CUDA only with on"}
    assert whys(plan)["linears"][2:] == [("onednn", False, "setting cpu_packed_linears=off"),
                                         ("dense", True, "torch's F.linear over the float weight")]
    assert whys(plan)["head"][1:3] == [("onednn", False, "setting cpu_packed_linears=off"),
                                       ("dense", True, "torch's product over the float weight")]


def test_a_new_forward_body_is_one_entry(models, tmp_path, monkeypatch):
    """An entry put first in the table is tried first: refused with its reason, or chosen."""
    no = Entry("probe-body", lambda start: (None, "refused for the test"))
    monkeypatch.setattr(choose, "FORWARD_BODIES", (no, *choose.FORWARD_BODIES))
    plan, _, _ = planned(models["llama"], tmp_path)
    assert plan.forward.candidates[0].why == "refused for the test" and plan.forward.chosen == "lean"
    body = Body(decoder=lambda ids, positions: ids)
    yes = Entry("probe-body", lambda start: (body, "taken for the test"))
    monkeypatch.setattr(choose, "FORWARD_BODIES", (yes, *choose.FORWARD_BODIES[1:]))
    plan, parts, _ = planned(models["llama"], tmp_path)
    assert plan.forward.chosen == "probe-body" and parts.body is body
    assert plan.forward.refused()["lean"] == "not tried: probe-body comes first"
