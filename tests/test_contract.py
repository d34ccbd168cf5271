"""The execution contract (moealign.contract): weight digests, the field-by-field comparison, the engines' contracts,
the record carrying the rollout side's contract, and `moealign mismatch --contract`."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from test_record import make_record

from moealign import record as rec_mod
from moealign.record import io as rec_io
from moealign.contract import (
    check_contract,
    compare_contracts,
    format_contract,
    gap_fields,
    gap_lines,
    weight_digests,
)
from moealign.errors import InputError, RecordError, RecordFormatError
from moealign.record import RolloutRecord

transformers = pytest.importorskip("transformers")

from moealign.embedded import embedded_model_path  # noqa: E402
from moealign.patches.hf.contract import contract_of  # noqa: E402
from moealign.patches.hf.loading import load_model  # noqa: E402
from moealign.precision.policy import get_policy  # noqa: E402
import warm

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

PATH = str(embedded_model_path())
NUM_LAYERS = 4


def _policy(name: str, **changes):
    try:
        return get_policy(name)
    except Exception:   # noqa: BLE001 - the fp32-head / fp32-router policies may not be registered
        base, region = "bf16", name.rpartition("-fp32-")[2]
        field = {"head": "lm_head_dtype", "router": "router_dtype"}[region]
        return get_policy(base).replace(name=name, **{field: torch.float32})


@pytest.fixture(scope="module")
def fp32_model():
    return load_model(PATH, "fp32", "cpu")[0]


@pytest.fixture(scope="module")
def contracts(fp32_model):
    """Contracts of the embedded model loaded in fp32, bf16, and bf16 with an fp32 LM head / router."""
    out = {"fp32": contract_of(fp32_model)}
    for name in ("bf16", "bf16-fp32-head", "bf16-fp32-router"):
        model = load_model(PATH, _policy(name), "cpu")[0]
        out[name] = contract_of(model)
    return out


def _by_field(rows):
    return {row["field"]: row for row in rows}


# --- weight digests ------------------------------------------------------------------------------------------

def test_fp32_and_bf16_holders_agree_at_bfloat16(contracts):
    a, b = contracts["fp32"]["weights"], contracts["bf16"]["weights"]
    assert sorted(a["digests"]) == ["bfloat16", "float16", "float32"]
    assert sorted(b["digests"]) == ["bfloat16"]
    assert a["dtype"] == "float32" and b["dtype"] == "bfloat16"
    assert a["digests"]["bfloat16"] == b["digests"]["bfloat16"]
    assert a["digests"]["float32"]["all"] != a["digests"]["bfloat16"]["all"]
    assert sorted(a["digests"]["float32"]["layers"]) == sorted(["embed", "0", "1", "2", "3", "norm", "lm_head"])
    row = _by_field(compare_contracts(contracts["fp32"], contracts["bf16"]))["weights.digests"]
    assert row["status"] == "same" and "bfloat16" in row["message"]


def test_mixed_holder_digests_only_at_roundings_every_tensor_holds(contracts):
    # an fp32 LM head in a bf16 model: float32 rounding would need every tensor held in fp32
    w = contracts["bf16-fp32-head"]["weights"]
    assert sorted(w["digests"]) == ["bfloat16"]
    assert w["dtype"] == "bfloat16"
    assert w["digests"]["bfloat16"] == contracts["bf16"]["weights"]["digests"]["bfloat16"]


def test_perturbing_one_layer_changes_exactly_that_digest(fp32_model, contracts):
    named = [(n, p.detach().clone()) for n, p in fp32_model.named_parameters()]
    victim = next(i for i, (n, _) in enumerate(named) if n.startswith("model.layers.2.") and "experts" in n)
    named[victim][1].view(-1)[7] += 1e-3
    w = weight_digests(named, NUM_LAYERS)
    ref = contracts["fp32"]["weights"]["digests"]
    for rounding in ("float32", "bfloat16"):
        differ = [k for k, v in w["digests"][rounding]["layers"].items() if v != ref[rounding]["layers"][k]]
        assert differ == ["2"], (rounding, differ)
    changed = dict(copy.deepcopy(contracts["fp32"]), weights=w)
    rows = compare_contracts(contracts["fp32"], changed)
    gaps = gap_fields(rows)
    assert [g["field"] for g in gaps] == ["weights.digests"]
    assert "layer 2" in gaps[0]["message"] and "float32" in gaps[0]["message"]
    assert "layer 1" not in gaps[0]["message"]


def test_digest_is_chunked_and_bounded(monkeypatch):
    import moealign.contract as mod

    t = torch.randn(1000)
    whole = weight_digests([("model.norm.weight", t)], 0)
    monkeypatch.setattr(mod, "_CHUNK", 7)
    assert weight_digests([("model.norm.weight", t)], 0) == whole


def test_weight_digests_refuse_bad_input():
    with pytest.raises(InputError, match="layer 5"):
        weight_digests([("model.layers.5.x", torch.zeros(2))], 4)
    with pytest.raises(InputError, match="no tensors"):
        weight_digests([], 4)
    with pytest.raises(InputError, match="twice"):
        weight_digests([("a", torch.zeros(1)), ("a", torch.zeros(1))], 0)


def test_no_common_rounding_is_info(contracts):
    fp16 = copy.deepcopy(contracts["bf16"])
    fp16["weights"]["digests"] = {"float16": fp16["weights"]["digests"]["bfloat16"]}
    row = _by_field(compare_contracts(contracts["bf16"], fp16))["weights.digests"]
    assert row["status"] == "info" and "not comparable" in row["message"]


# --- the comparison ----------------------------------------------------------------------------------------------

def test_same_policy_has_no_gap(contracts):
    rows = compare_contracts(contracts["bf16"], contracts["bf16"])
    assert gap_fields(rows) == []
    assert "no field known to cause a gap" in format_contract(rows)


def test_one_sided_fp32_head_is_flagged(contracts):
    rows = compare_contracts(contracts["bf16-fp32-head"], contracts["bf16"])
    gaps = gap_fields(rows)
    assert [g["field"] for g in gaps] == ["dtypes.lm_head", "dtypes.logits"]
    assert gaps[0]["message"] == ("rollout computes the LM head in float32, train in bfloat16: a one-sided fp32 LM "
                                  "head makes the mismatch worse, not better; use the same dtype on both sides")
    line = gap_lines(rows)[0]
    assert line.startswith("contract: dtypes.lm_head differs (rollout float32, train bfloat16): ")
    assert "a one-sided fp32 LM head makes the mismatch worse" in line
    # the other way round names the train side
    flipped = gap_fields(compare_contracts(contracts["bf16"], contracts["bf16-fp32-head"]))[0]
    assert flipped["message"].startswith("train computes the LM head in float32, rollout in bfloat16")


def test_one_sided_fp32_router_is_flagged(contracts):
    assert contracts["bf16-fp32-router"]["dtypes"]["router"] == "float32"
    gaps = gap_fields(compare_contracts(contracts["bf16-fp32-router"], contracts["bf16"]))
    assert [g["field"] for g in gaps] == ["dtypes.router"]
    assert "one-sided fp32 router makes the mismatch worse" in gaps[0]["message"]


def test_whole_model_dtype_difference_is_a_plain_dtype_gap(contracts):
    gaps = _by_field(gap_fields(compare_contracts(contracts["fp32"], contracts["bf16"])))
    assert set(gaps) == {f"dtypes.{r}" for r in ("router", "attention", "experts", "lm_head", "logits")}
    assert "one-sided" not in gaps["dtypes.lm_head"]["message"]


def _tp(contract, tp, tree):
    c = copy.deepcopy(contract)
    c["parallel"]["tp"], c["switches"]["tree_reductions"] = tp, tree
    return c


def test_tp_sizes_without_tree_reductions_are_a_gap(contracts):
    base = contracts["bf16"]
    rows = _by_field(compare_contracts(_tp(base, 2, False), _tp(base, 1, False)))
    assert rows["parallel.tp"]["status"] == "gap" and "order" in rows["parallel.tp"]["message"]
    rows = _by_field(compare_contracts(_tp(base, 2, True), _tp(base, 1, False)))
    assert rows["parallel.tp"]["status"] == "gap" and "train side" in rows["parallel.tp"]["message"]
    rows = _by_field(compare_contracts(_tp(base, 2, True), _tp(base, 1, True)))
    assert rows["parallel.tp"]["status"] == "info"
    assert gap_fields(list(rows.values())) == []


def test_switches_kernels_engines_sampling_and_missing_sections(contracts):
    a, b = copy.deepcopy(contracts["bf16"]), copy.deepcopy(contracts["bf16"])
    a["switches"]["batch_invariant"] = True
    a["kernels"]["attention"] = "eager"
    a["engine_version"] = "0.0"
    a["sampling"] = {"temperature": 1.0, "top_k": 0, "top_p": 0.9, "min_p": 0.0}
    rows = _by_field(compare_contracts(a, b))
    assert rows["switches.batch_invariant"]["status"] == "info"
    assert "batch composition" in rows["switches.batch_invariant"]["message"]
    assert rows["kernels.attention"]["status"] == "info" and "eager" in rows["kernels.attention"]["message"]
    assert rows["engine_version"]["status"] == "info"
    assert rows["sampling"]["status"] == "info" and rows["sampling"]["message"] == "not stated by the train side"
    b["sampling"] = dict(a["sampling"], top_p=1.0)
    rows = _by_field(compare_contracts(a, b))
    assert rows["sampling.top_p"]["status"] == "gap"
    del b["weights"], b["kernels"]
    rows = _by_field(compare_contracts(a, b))
    assert rows["weights"]["message"] == "not stated by the train side"
    assert rows["kernels"]["status"] == "info"


@pytest.mark.parametrize("change, fragment", [
    (lambda c: c.update(engine=3), "engine"),
    (lambda c: c["dtypes"].update(router="float33"), "dtypes.router"),
    (lambda c: c["parallel"].update(tp=-1), "parallel.tp"),
    (lambda c: c["parallel"].update(ep=True), "parallel.ep"),
    (lambda c: c["switches"].update(batch_invariant="yes"), "switches.batch_invariant"),
    (lambda c: c["weights"]["digests"]["bfloat16"].update(all="abc"), "64 lowercase hex"),
    (lambda c: c["weights"]["digests"]["bfloat16"]["layers"].update({"0": "G" * 64}), "layers.0"),
    (lambda c: c["weights"]["digests"].update(float8={}), "rounding dtype"),
    (lambda c: c.update(extra=1), "unknown keys"),
    (lambda c: c.update(sampling={"temperature": float("nan")}), "sampling.temperature"),
])
def test_malformed_contracts_are_refused(contracts, change, fragment):
    c = copy.deepcopy(contracts["bf16"])
    change(c)
    with pytest.raises(RecordError, match="contract: ") as info:
        check_contract(c)
    assert fragment in str(info.value)


# --- Megatron --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron():
    pytest.importorskip("megatron.core")
    from moealign.mismatch.engines import MegatronTrainEngine

    engine = MegatronTrainEngine(PATH, "fp32", "cpu")
    yield engine
    engine.close()


def test_megatron_digests_equal_transformers_at_float32(megatron, contracts):
    c = megatron.contract({"temperature": 1.0, "top_k": 0, "top_p": 0.9, "min_p": 0.0})
    assert c["engine"] == "megatron"
    assert c["parallel"] == {"tp": 1, "ep": 1, "sp": 1, "cp": 1}
    assert c["dtypes"] == {"router": "float32", "attention": "float32", "experts": "float32", "lm_head": "float32",
                           "logits": "float32"}
    assert c["weights"]["digests"]["float32"] == contracts["fp32"]["weights"]["digests"]["float32"]
    rows = _by_field(compare_contracts(contracts["fp32"], c))
    assert rows["weights.digests"]["status"] == "same" and "float32" in rows["weights.digests"]["message"]


def test_megatron_perturbed_conversion_is_named(megatron, contracts):
    from moealign.patches.megatron.checkpoint import hf_state_dict_from_megatron

    state = {k: v.clone() for k, v in hf_state_dict_from_megatron(megatron.model, megatron._hf_config).items()}
    name = next(k for k in state if k.startswith("model.layers.1.self_attn."))
    state[name].view(-1)[0] += 1e-2
    c = dict(megatron.contract(), weights=weight_digests(state.items(), NUM_LAYERS))
    gaps = gap_fields(compare_contracts(contracts["fp32"], c))
    assert [g["field"] for g in gaps] == ["weights.digests"]
    assert gaps[0]["message"].startswith("weights differ in layer 1 at float32")


# --- the record carries the rollout side's contract -----------------------------------------------------------

def test_record_round_trips_its_contract(contracts, tmp_path):
    rec = make_record(shapes=[(5, 2), (4, 1)], seed=3)
    rec.contract = contracts["bf16-fp32-head"]
    path = tmp_path / "r.safetensors"
    rec.save(path)
    back = RolloutRecord.load(path)
    assert back.contract == contracts["bf16-fp32-head"]
    assert rec_mod.with_meta(back, model_name="x").contract == back.contract
    plain = make_record(shapes=[(5, 2)], seed=3)
    plain.save(tmp_path / "p.safetensors")
    assert RolloutRecord.load(tmp_path / "p.safetensors").contract is None


def _rewrite(path, out, contract_text, *, fix_checksum: bool):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    metadata["moealign.contract"] = contract_text
    if fix_checksum:
        metadata["moealign.checksum"] = rec_io._checksum(tensors, metadata)
    save_file(tensors, str(out), metadata=metadata)


def test_tampered_contract_fails_the_checksum(contracts, tmp_path):
    rec = make_record(shapes=[(5, 2)], seed=3)
    rec.contract = contracts["bf16"]
    rec.save(tmp_path / "r.safetensors")
    tampered = copy.deepcopy(contracts["bf16"])
    tampered["dtypes"]["lm_head"] = "float32"
    _rewrite(tmp_path / "r.safetensors", tmp_path / "t.safetensors", json.dumps(tampered, sort_keys=True),
             fix_checksum=False)
    with pytest.raises(RecordFormatError, match="checksum"):
        RolloutRecord.load(tmp_path / "t.safetensors")


@pytest.mark.parametrize("text, fragment", [("{not json", "not JSON"), ("[1]", "must be an object"),
                                            ('{"engine": "x", "parallel": {"tp": 0}}', "parallel.tp")])
def test_malformed_contract_in_a_file_is_refused(tmp_path, text, fragment):
    make_record(shapes=[(5, 2)], seed=3).save(tmp_path / "r.safetensors")
    _rewrite(tmp_path / "r.safetensors", tmp_path / "m.safetensors", text, fix_checksum=True)
    with pytest.raises(RecordFormatError, match="contract") as info:
        RolloutRecord.load(tmp_path / "m.safetensors")
    assert fragment in str(info.value)


def test_record_refuses_a_malformed_contract_at_save(tmp_path):
    rec = make_record(shapes=[(5, 2)], seed=3)
    rec.contract = {"engine": ""}
    with pytest.raises(RecordError, match="engine"):
        rec.save(tmp_path / "r.safetensors")


# --- the CLI -------------------------------------------------------------------------------------------------------

def _cli(*argv, timeout=600):
    return warm.run([sys.executable, "-m", "moealign", "mismatch", "--contract", "-q", "--device", "cpu", *argv],
                          capture_output=True, text=True, timeout=timeout)


def test_cli_same_precision_exits_0_and_writes_json(tmp_path):
    out = tmp_path / "c.json"
    p = _cli("--rollout", "hf", "--train", "megatron", "--rollout-precision", "fp32", "--train-precision", "fp32",
             "--json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "no field known to cause a gap differs" in p.stdout
    data = json.loads(out.read_text())
    assert set(data) >= {"rollout", "train", "fields"}
    assert data["rollout"]["engine"] == "transformers" and data["train"]["engine"] == "megatron"
    fields = {row["field"]: row for row in data["fields"]}
    assert fields["weights.digests"]["status"] == "same"


def test_cli_bf16_both_sides_exits_0():
    p = _cli("--rollout", "hf", "--train", "hf", "--rollout-precision", "bf16", "--train-precision", "bf16")
    assert p.returncode == 0, p.stderr[-2000:]


def test_cli_dtype_difference_exits_3_naming_dtypes():
    p = _cli("--rollout", "hf", "--train", "hf", "--rollout-precision", "fp32", "--train-precision", "bf16")
    assert p.returncode == 3, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if "contract: " in line]
    assert any("contract: dtypes.lm_head differs (rollout float32, train bfloat16)" in line for line in lines), lines
    assert all("dtypes." in line for line in lines)


def test_cli_one_sided_head_exits_3_with_the_message():
    try:
        get_policy("bf16-fp32-head")
    except Exception:   # noqa: BLE001
        pytest.skip("bf16-fp32-head is not registered")
    p = _cli("--rollout", "hf", "--train", "hf", "--rollout-precision", "bf16-fp32-head", "--train-precision", "bf16")
    assert p.returncode == 3
    assert "a one-sided fp32 LM head makes the mismatch worse, not better" in p.stderr


@pytest.mark.parametrize("argv, fragment", [
    (["--rollout", "hf", "--train", "hf", "--sweep"], "--contract compares"),
    (["--rollout", "hf", "--train", "hf", "--rollout-precision", "nope"], "unknown precision policy"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, fragment):
    p = _cli(*argv)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and fragment in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_cli_record_without_contract_is_one_line_exit_2(tmp_path):
    path = tmp_path / "r.safetensors"
    make_record(shapes=[(5, 2)], seed=3).save(path)
    p = _cli("--train", "hf", "--load-record", str(path))
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "states no execution contract" in p.stderr, p.stderr


def test_cli_default_engines_vllm_megatron_bf16_exits_0(tmp_path):
    """The main job's engines (vLLM rolls out, Megatron trains), each in the child process the CLI is."""
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    from vllm_util import child_env

    out = tmp_path / "c.json"
    p = warm.run([sys.executable, "-m", "moealign", "mismatch", "--contract", "-q", "--rollout-precision",
                        "bf16", "--train-precision", "bf16", "--json", str(out)], capture_output=True, text=True,
                       timeout=600, env=child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["rollout"]["engine"] == "vllm" and data["train"]["engine"] == "megatron"
    assert data["rollout"]["dtypes"]["lm_head"] == "bfloat16" and data["rollout"]["parallel"]["tp"] == 1
    w = data["rollout"]["weights"]
    assert w["digests"] or w["note"]          # CPU vLLM packs its weights: a note instead of digests
