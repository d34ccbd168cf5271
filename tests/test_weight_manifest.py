"""Weight manifests (issue 35 part 5): the trainer's weights as per-tensor layout digests in a small file, written in
one process (this one), verifying a vLLM engine in another (tests/vllm_manifest_child.py: TP 1, bf16, its CPU
experts prepacked); a refit with tensors changed is caught naming them; a corrupt or hostile file is refused by
name; the file stays under 1% of the model's bytes. TP 2: the manifest check on a real two-worker engine runs in
tests/test_rl_refit.py's TP 2 child (its engine is already up: a second two-worker start costs 40-110 s here), and
the summing of shards over workers (row / column / GLU / vocabulary / replicated / KV-replica shards, a shard
missing, replicas that disagree) runs here on simulated worker answers built from vLLM's own shard rules. The
digest's algebra (shards add up to the whole) and the packed-layout reading are tested engine-free."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moealign._optional import probe
from moealign.errors import ConfigError, InputError, InputTypeError, MissingFileError

from vllm_util import run_child

pytestmark = pytest.mark.heavy          # one vLLM engine in a child process (tests/conftest.py)

VLLM = probe("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")

CHANGED = {"model.layers.2.self_attn.o_proj.weight", "model.layers.1.mlp.experts.down_proj[3]"}


@pytest.fixture(scope="module")
def embedded_model():
    from transformers import AutoModelForCausalLM

    from moealign.embedded import embedded_model_path

    return AutoModelForCausalLM.from_pretrained(str(embedded_model_path()), dtype=torch.float32)


@pytest.fixture(scope="module")
def manifest_file(embedded_model, tmp_path_factory):
    from moealign.rl import weight_manifest

    path = tmp_path_factory.mktemp("manifest") / "step.manifest.json"
    weight_manifest(embedded_model).save(path)          # written here, verified by the engine's own process
    return str(path)


@pytest.fixture(scope="module")
def tp1(manifest_file) -> dict:
    return run_child("vllm_manifest_child.py", "1", "bf16", manifest_file)


# --------------------------------------------------------------------------------------------------
# on the engine, in another process
# --------------------------------------------------------------------------------------------------


@needs_vllm
def test_manifest_from_another_process_verifies_the_engine(tp1):
    r = tp1
    assert r["ok"], r["mismatches"]
    assert r["workers"] == r["tp"] and r["checked"] == 167 * r["tp"]      # every shard of every worker
    assert r["packed"] > 0                  # oneDNN linears read through the kernel, CPU experts unpacked
    assert r["config_mismatches"] == []
    assert r["restored"]                    # and again after the changed refit was undone


@needs_vllm
def test_changed_tensors_are_named(tp1):
    r = tp1
    assert not r["changed_ok"]
    assert r["changed"] == sorted([name, 0] for name in CHANGED)
    assert r["changed_control"]             # the manifest of the changed weights verifies the same engine
    assert r["in_process_agrees"]           # and so does the in-process check against the changed tensors


@needs_vllm
def test_a_manifest_without_the_engines_dtype_names_it(tp1):
    assert not tp1["no_dtype_ok"]
    assert tp1["no_dtype"] and all("dtype bfloat16" in why for why in tp1["no_dtype"])


# --------------------------------------------------------------------------------------------------
# the file
# --------------------------------------------------------------------------------------------------


def test_manifest_is_under_one_percent_of_the_model(embedded_model):
    from moealign.rl import weight_manifest

    m = weight_manifest(embedded_model)
    assert len(m) == 167 and m.dtypes == ("bfloat16", "float16", "float32")
    assert m.model_bytes == sum(t.numel() * t.element_size() for t in embedded_model.state_dict().values())
    assert m.nbytes / m.model_bytes < 0.01                 # embedded model: 0.36%


def test_manifest_of_the_432m_layout_is_under_one_percent():
    # the file's size depends only on the names, shapes and dtypes (each digest is 32 hex digits): the layout of
    # the refit benchmark's 432M-parameter model (tools/bench_refit.py), built on the meta device, with its digests
    # replaced by the widest value
    from transformers import AutoConfig, AutoModelForCausalLM

    from moealign.embedded import embedded_model_path
    from moealign.rl import WeightManifest
    from moealign.rl.manifest import DEFAULT_DTYPES

    config = AutoConfig.from_pretrained(str(embedded_model_path()))
    for k, v in dict(hidden_size=1024, num_hidden_layers=8, num_experts=32, num_experts_per_tok=4,
                     moe_intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=128).items():
        setattr(config, k, v)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    top = (1 << 64) - 1
    tensors, nbytes = {}, 0
    for name, t in model.state_dict().items():
        nbytes += t.numel() * 2
        names = [f"{name}[{e}]" for e in range(t.shape[0])] if ".mlp.experts." in name else [name]
        for n in names:
            tensors[n] = (tuple(t.shape[1:] if n.endswith("]") else t.shape), {d: (top, top) for d in DEFAULT_DTYPES})
    m = WeightManifest(tensors=tensors, model_bytes=nbytes)
    assert 430e6 < nbytes / 2 < 435e6
    assert m.nbytes / nbytes < 0.001                         # 0.02%


def test_save_load_round_trip_and_atomic(embedded_model, tmp_path):
    from moealign.rl import WeightManifest, weight_manifest

    m = weight_manifest(embedded_model, dtypes=["bfloat16"])
    path = tmp_path / "m.json"
    path.write_text("old")
    assert m.save(path) == str(path)
    back = WeightManifest.load(path)
    assert back.tensors == m.tensors and back.config == m.config and back.model_bytes == m.model_bytes
    assert back.config["num_hidden_layers"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]           # no temporary file left
    with pytest.raises(ConfigError, match="not a regular file"):
        m.save(tmp_path)                                                  # a directory is not replaced


def _hostile(tmp_path, text: str, name: str = "bad.json") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def good_dict(embedded_model) -> dict:
    from moealign.rl import weight_manifest

    return weight_manifest(embedded_model, dtypes=["float32"]).to_dict()


@pytest.mark.parametrize("case, needle", [
    ("not json", "is not JSON"),
    ("nan", "is not JSON"),
    ("array", "not a weight manifest"),
    ("format", "not a weight manifest"),
    ("version", "manifest version 2"),
    ("digest", "digests of 'sha1'"),
    ("unknown field", "unknown fields ['extra']"),
    ("missing field", "missing fields ['tensors']"),
    ("hex", "32 lowercase hex digits"),
    ("bool shape", "the shape must be"),
    ("negative shape", "the shape must be"),
    ("control name", "printable strings"),
    ("dtype", "unknown dtype 'float128'"),
    ("empty", "no tensors"),
    ("config", "are not ones moealign compares"),
    ("model bytes", "model_bytes must be"),
    ("deep", "nested too deeply"),
])
def test_corrupt_or_hostile_file_is_refused_by_name(case, needle, good_dict, tmp_path):
    from moealign.rl import WeightManifest

    d = json.loads(json.dumps(good_dict))
    name = next(iter(d["tensors"]))
    if case == "not json":
        text = '{"format": "moealign-weight-manifest", '
    elif case == "nan":
        text = json.dumps(d).replace('"model_bytes": ' + str(d["model_bytes"]), '"model_bytes": NaN')
    elif case == "array":
        text = "[1, 2]"
    elif case == "deep":
        text = "[" * 100 + "]" * 100
    else:
        if case == "format":
            d["format"] = "safetensors"
        elif case == "version":
            d["version"] = 2
        elif case == "digest":
            d["digest"] = "sha1"
        elif case == "unknown field":
            d["extra"] = 1
        elif case == "missing field":
            del d["tensors"]
        elif case == "hex":
            d["tensors"][name][1]["float32"] = "zz" * 16
        elif case == "bool shape":
            d["tensors"][name][0] = [True, 4]
        elif case == "negative shape":
            d["tensors"][name][0] = [-1, 4]
        elif case == "control name":
            d["tensors"]["bad\nname"] = d["tensors"][name]
        elif case == "dtype":
            d["tensors"][name][1]["float128"] = d["tensors"][name][1]["float32"]
        elif case == "empty":
            d["tensors"] = {}
        elif case == "config":
            d["config"]["__class__"] = "os.system"
        elif case == "model bytes":
            d["model_bytes"] = -5
        text = json.dumps(d)
    path = _hostile(tmp_path, text)
    with pytest.raises(InputError) as err:
        WeightManifest.load(path)
    assert needle in str(err.value) and path in str(err.value), str(err.value)
    # the control: the untouched dictionary loads
    WeightManifest.load(_hostile(tmp_path, json.dumps(good_dict), "good.json"))


def test_special_and_oversized_files_are_refused(good_dict, tmp_path, monkeypatch):
    from moealign.rl import WeightManifest
    from moealign.rl import manifest as mod

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        WeightManifest.load(fifo)                         # refused before it is opened: no hang
    with pytest.raises(InputError):
        WeightManifest.load(tmp_path)                     # a directory
    with pytest.raises(MissingFileError, match="no such file"):
        WeightManifest.load(tmp_path / "absent.json")
    path = _hostile(tmp_path, json.dumps(good_dict))
    monkeypatch.setattr(mod, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(InputError, match="more than the 1000"):
        WeightManifest.load(path)


def test_merge_joins_ranks_and_refuses_disagreement(embedded_model):
    from moealign.rl import WeightManifest, weight_manifest

    state = embedded_model.state_dict()
    names = list(state)
    whole = weight_manifest(state, embedded_model.config, dtypes=["float32"])
    a = weight_manifest({n: state[n] for n in names[:10]}, embedded_model.config, dtypes=["float32"])
    b = weight_manifest({n: state[n] for n in names[5:]}, embedded_model.config, dtypes=["float32"])
    merged = WeightManifest.merge([a, b])                  # overlapping tensors (replicated on two ranks) agree
    assert merged.tensors == whole.tensors
    other = dict(state)
    other[names[7]] = state[names[7]] + 1
    c = weight_manifest({n: other[n] for n in names[5:]}, embedded_model.config, dtypes=["float32"])
    with pytest.raises(InputError, match=names[7].replace(".", r"\.")):
        WeightManifest.merge([a, c])
    with pytest.raises(InputTypeError):
        WeightManifest.merge([a, {"x": 1}])


def test_weight_manifest_refuses_bad_arguments(embedded_model):
    from moealign.rl import weight_manifest

    with pytest.raises(InputTypeError):
        weight_manifest([1, 2])
    with pytest.raises(ConfigError, match="dtypes"):
        weight_manifest(embedded_model, dtypes=["float128"])
    with pytest.raises(InputError, match="meta"):
        weight_manifest({"w": torch.ones(2, device="meta")})
    with pytest.raises(InputTypeError, match="not a tensor"):
        weight_manifest({"w": [1.0]})


# --------------------------------------------------------------------------------------------------
# the digest, engine-free
# --------------------------------------------------------------------------------------------------


def _py_splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_keys_are_a_pure_function_of_the_index():
    from moealign.patches.vllm.refit import _keys

    for kind in (0, 1):
        table = _keys(kind, 1000, 1010, "cpu")
        for i in range(10):
            for lane in (0, 1):
                want = _py_splitmix64(1000 + i + ((2 * kind + lane + 1) << 48)) | 1
                assert int(table[i, lane]) & ((1 << 64) - 1) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shards_add_up_to_the_digest_of_the_whole(dtype):
    from moealign.patches.vllm.refit import (_as_rows, _expected, expected_lanes, layout_digest, shard_span,
                                             span_lanes)

    m64 = (1 << 64) - 1

    def total(parts):
        return tuple(sum(int(p[j]) for p in parts) & m64 for j in (0, 1))

    g = torch.Generator().manual_seed(0)
    experts = torch.randn(3, 12, 10, generator=g).to(dtype)            # [E, 2I, H]
    assert layout_digest(experts, rows=True) == [layout_digest(experts[e]) for e in range(3)]
    for shard_of in (lambda r, w: ("glu", 1, r, w), lambda r, w: ("chunk", 2, r, w)):
        for world in (1, 2):
            for e in range(3):
                parts = []
                for rank in range(world):
                    shard = ("expert", e, shard_of(rank, world))
                    held = _expected(experts, shard)                    # what vLLM's worker holds of expert e
                    rows, col, n = shard_span(shard, (12, 10))
                    parts.append(span_lanes(_as_rows(held).unsqueeze(0), rows, col)[0].tolist())
                    lead = expected_lanes(experts, shard, (12, 10), dtype, lead=True)[e].tolist()
                    assert total([lead]) == total([parts[-1]])          # the trainer's side, every expert at once
                assert total(parts) == layout_digest(experts[e])
    w = torch.randn(10, 6, generator=g).to(dtype)
    for world in (2, 3, 6):                                             # 6 columns / 3 or 6: not word-aligned
        parts = [span_lanes(_expected(w, ("chunk", 1, r, world)).unsqueeze(0), *shard_span(("chunk", 1, r, world),
                                                                                           (10, 6))[:2])[0].tolist()
                 for r in range(world)]
        assert total(parts) == layout_digest(w)
    # the negative controls: one flipped bit, a transposition, a swapped pair of shards
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    flipped = w.clone()
    flipped.view(bits)[3, 4] ^= 1
    square = torch.randn(8, 8, generator=g).to(dtype)
    assert layout_digest(flipped) != layout_digest(w)
    assert layout_digest(square.t().contiguous()) != layout_digest(square)
    swapped = span_lanes(w[:5].unsqueeze(0), [(5, 10)])[0] + span_lanes(w[5:].unsqueeze(0), [(0, 5)])[0]
    assert total([swapped.tolist()]) != layout_digest(w)


def test_packed_layout_is_read_as_a_strided_view():
    from moealign.patches.vllm.refit import _strided_inverse

    n, k = 32, 8
    logical = torch.arange(n * k).reshape(n, k)
    for packed in (logical.reshape(n // 16, 16, k).transpose(1, 2).contiguous(),               # vLLM's "vec"
                   logical.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()):  # "amx" (VNNI pairs)
        inv = torch.empty(n * k, dtype=torch.int64)
        inv[packed.reshape(-1)] = torch.arange(n * k)                     # inv[l] = where logical element l lies
        sizes, strides = _strided_inverse(inv)
        assert torch.equal(packed.reshape(-1).as_strided(sizes, strides).reshape(n, k), logical)
    shuffled = torch.randperm(n * k, generator=torch.Generator().manual_seed(1))
    assert _strided_inverse(shuffled) is None                             # no strided view: the caller gathers


def test_digest_kernel_has_the_torch_paths_bits(monkeypatch):
    """The native digest kernel (moealign._native, what span_lanes runs on a CPU) against span_lanes' torch path
    (MOEALIGN_DIGEST_KERNEL=0), torch.equal: every element size, word-aligned and unaligned column starts, row
    ranges out of order, columns read through a stride (a transposed view), vLLM's vec packing read in place as an
    [E, Mo, Mi, K] view. Negative controls by construction: one flipped bit of the packed storage, and the packed
    storage digested as if it were the logical layout, both change the lanes."""
    from moealign._native import extension
    from moealign.patches.vllm import refit as vr

    if extension("digest") is None:
        pytest.skip("moealign's native extension cannot be built here (no compiler): the torch path runs")

    def both(t, rows, col=0):
        native = vr._native_lanes(t, rows, col)
        assert native is not None                                      # the kernel ran (not the fallback)
        monkeypatch.setenv("MOEALIGN_DIGEST_KERNEL", "0")
        assert vr._native_lanes(t, rows, col) is None
        reference = vr.span_lanes(t, rows, col)
        monkeypatch.delenv("MOEALIGN_DIGEST_KERNEL")
        assert torch.equal(native, vr.span_lanes(t, rows, col))
        return native, reference

    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64, torch.bool):
        for lead, m, n, col in ((3, 5, 7, 0), (2, 4, 9, 3), (1, 6, 16, 5), (2, 3, 1, 1), (1, 2, 0, 0)):
            t = (torch.randn(lead, m, n + col, generator=g) * 50).to(dtype)[..., col:]
            native, reference = both(t, [(4, 4 + m - 1), (0, 1)], col)
            assert torch.equal(native, reference), (dtype, lead, m, n, col)
            strided = (torch.randn(lead, n + col, m, generator=g) * 50).to(dtype).transpose(1, 2)[..., col:]
            assert torch.equal(*both(strided, [(0, m)], col)), (dtype, "strided")
    e, n, k = 3, 64, 40
    logical = torch.randn(e, n, k, generator=g).to(torch.bfloat16)
    packed = logical.reshape(e, n // 16, 16, k).transpose(2, 3).contiguous()      # vLLM's vec: [N / 16, K, 16]

    def read(storage):
        return storage.as_strided([e, n // 16, 16, k], [n * k, 16 * k, 1, 16])

    for rows, col in (([(0, n)], 0), ([(0, n // 2), (n, n + n // 2)], 4)):
        want = vr.span_lanes(logical, rows, col)
        native, reference = both(read(packed), rows, col)
        assert torch.equal(native, want) and torch.equal(reference, want)
        flipped = packed.clone()
        flipped.view(torch.int16).view(-1)[n * k + 1234] ^= 1                      # in expert 1
        assert not torch.equal(vr.span_lanes(read(flipped), rows, col)[1], want[1])
        assert torch.equal(vr.span_lanes(read(flipped), rows, col)[0::2], want[0::2])   # only expert 1 changed
        assert not torch.equal(vr.span_lanes(packed.reshape(e, n, k), rows, col), want)


# --------------------------------------------------------------------------------------------------
# shards summed over workers: simulated answers of a TP 2 engine
# --------------------------------------------------------------------------------------------------


def _worker_answers(state: dict, tp: int, kv_world: int) -> list[dict]:
    """What each of ``tp`` workers would answer (``_rpc_held``'s entries) for ``state`` under vLLM's TP rules:
    q rows, k / v rows over ``kv_world`` distinct shards (replicated when fewer KV heads than ranks), o columns,
    experts (GLU rows of gate_up, columns of down), vocabulary rows, replicated norms."""
    from moealign.patches.vllm.refit import _as_rows, _expected, _unsigned, shard_span, span_lanes

    def entry(t, shard, full_shape):
        rows, col, _ = shard_span(shard, full_shape)
        lanes = _unsigned(span_lanes(_as_rows(t).unsqueeze(0), rows, col)[0].tolist())
        return (lanes, tuple(t.shape), str(t.dtype).replace("torch.", ""), shard, False, tuple(full_shape))

    out = []
    for rank in range(tp):
        held = {}
        for name, full in state.items():
            if name.endswith("q_proj.weight"):
                shard = ("chunk", 0, rank, tp)
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                shard = ("chunk", 0, rank * kv_world // tp, kv_world)
            elif name.endswith("o_proj.weight"):
                shard = ("chunk", 1, rank, tp)
            elif name.endswith("embed_tokens.weight"):
                step = full.shape[0] // tp
                shard = ("rows", rank * step, (rank + 1) * step)
            elif name.endswith(("gate_up_proj", "down_proj")):
                inner = ("glu", 1, rank, tp) if name.endswith("gate_up_proj") else ("chunk", 2, rank, tp)
                for e in range(full.shape[0]):
                    held[f"{name}[{e}]"] = entry(_expected(full, ("expert", e, inner)), ("expert", e, inner),
                                                 tuple(full.shape[1:]))
                continue
            else:
                shard = ("full",)
            held[name] = entry(_expected(full, shard), shard, tuple(full.shape))
        out.append(held)
    return out


@pytest.fixture()
def sim(monkeypatch):
    from moealign.patches.vllm import refit as vr
    from moealign.rl import weight_manifest

    g = torch.Generator().manual_seed(3)
    state = {"model.embed_tokens.weight": torch.randn(16, 8, generator=g),
             "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
             "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 8, generator=g),
             "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8, generator=g),
             "model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 16, 8, generator=g),
             "model.layers.0.mlp.experts.down_proj": torch.randn(3, 8, 8, generator=g),
             "model.norm.weight": torch.randn(8, generator=g)}
    answers: dict = {}
    monkeypatch.setattr(vr, "held_tensors", lambda llm: answers["now"])

    def run(held_state, tp=2, kv_world=1, dtypes=("float32",), manifest_state=None, edit=None):
        answers["now"] = _worker_answers(held_state, tp, kv_world)
        if edit:
            edit(answers["now"])
        m = weight_manifest(manifest_state or state, dtypes=list(dtypes))
        check = vr.verify_digests(None, m.digests())
        return check, sorted((n, r) for n, r, _ in check.mismatches), [w for _, _, w in check.mismatches]

    return state, run


def test_shards_summed_over_workers_verify(sim):
    state, run = sim
    for tp, kv_world in ((1, 1), (2, 1), (2, 2), (4, 2)):   # kv_world < tp: k replicated over workers
        check, named, _ = run(state, tp, kv_world)
        assert check.ok and named == [], (tp, kv_world, check.mismatches)
        assert check.checked == tp * (5 + 3 + 3)


def test_a_split_tensor_that_differs_names_every_worker_holding_a_part(sim):
    state, run = sim
    changed = dict(state)
    o = "model.layers.0.self_attn.o_proj.weight"
    changed[o] = state[o].clone()
    changed[o][2, 6] += 1                                    # in rank 1's columns only
    e = "model.layers.0.mlp.experts.gate_up_proj"
    changed[e] = state[e].clone()
    changed[e][1, 13, 0] += 1                                 # expert 1, the up half, rank 1's rows
    check, named, why = run(changed)
    assert named == [(f"{e}[1]", 0), (f"{e}[1]", 1), (o, 0), (o, 1)]
    assert all("together" in w for w in why)


def test_replicated_tensors_are_named_per_worker_and_replicas_must_agree(sim):
    state, run = sim

    def bad_norm(answers):
        lanes, *rest = answers[1]["model.norm.weight"]
        answers[1]["model.norm.weight"] = ((lanes[0] ^ 1, lanes[1]), *rest)

    _, named, _ = run(state, edit=bad_norm)
    assert named == [("model.norm.weight", 1)]               # held whole: the worker is named

    def bad_replica(answers):
        k = "model.layers.0.self_attn.k_proj.weight"
        lanes, *rest = answers[0][k]
        answers[0][k] = ((lanes[0] + 1, lanes[1]), *rest)

    k = "model.layers.0.self_attn.k_proj.weight"
    _, named, _ = run(state, kv_world=1, edit=bad_replica)
    assert named == [(k, 0)]                                 # each worker holds all of k: the one that differs
    _, named, why = run(state, tp=4, kv_world=2, edit=bad_replica)
    assert named == [(k, 0), (k, 1)] and "same shard with different bytes" in why[0]    # replicas of half of k


def test_missing_shards_extra_tensors_and_dtypes_are_named(sim):
    state, run = sim

    def drop(answers):
        del answers[1]["model.layers.0.self_attn.q_proj.weight"]

    _, named, why = run(state, edit=drop)
    assert named == [("model.layers.0.self_attn.q_proj.weight", 0)] and "do not tile" in why[0]
    partial = {n: t for n, t in state.items() if n != "model.norm.weight"}
    _, named, why = run(state, manifest_state=partial)
    assert named == [("model.norm.weight", 0), ("model.norm.weight", 1)]
    assert all("no such tensor" in w for w in why)
    extra = dict(state, **{"model.layers.9.mlp.gate.weight": torch.ones(3, 8)})
    _, named, why = run(state, manifest_state=extra)
    assert named == [("model.layers.9.mlp.gate.weight", -1)] and "engine holds no such tensor" in why[0]
    check, named, why = run(state, dtypes=("bfloat16",))
    assert not check.ok and all("dtype float32" in w for w in why)
