"""peft_format: per-module rank/scaling and targets against PEFT's own model, identity, and
every rejection naming its problem."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import save_file

from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.peft_format import compute_content_hash, inspect_adapter_dir, load_adapter_files
from tests.fixtures.peft_adapters import peft_model_for, write_safetensors_raw
from tests.lora.adapter_edits import copy_adapter, edit_config, edit_tensors


def peft_modules(base, adapter_dir) -> dict[tuple[int, str], tuple[int, float]]:
    """(layer, module) -> (rank, scaling) as PEFT itself sets them up."""
    from peft.tuners.lora import LoraLayer

    model = peft_model_for(base, {"default": adapter_dir})
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.r:
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            out[(layer, name.rsplit(".", 1)[1])] = (mod.r["default"], mod.scaling["default"])
    return out


CASES = {
    "plain": dict(r=4, lora_alpha=7, target_modules=["q_proj", "v_proj", "down_proj"]),
    "rslora": dict(r=8, lora_alpha=5, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"]),
    "patterns": dict(
        r=4,
        lora_alpha=3,
        target_modules=["q_proj", "k_proj", "v_proj", "gate_proj"],
        rank_pattern={"k_proj": 2, "layers.1.self_attn.q_proj": 8},
        alpha_pattern={"v_proj": 11, "gate_proj": 1.5},
    ),
    "layers": dict(r=2, lora_alpha=4, target_modules=["q_proj", "up_proj"], layers_to_transform=[1]),
    "layers_pattern": dict(
        r=2, lora_alpha=4, target_modules=["o_proj"], layers_to_transform=0, layers_pattern="layers"
    ),
    "regex": dict(r=2, lora_alpha=3, target_modules=r".*\.1\.mlp\.(gate|down)_proj"),
    "exclude": dict(r=2, lora_alpha=3, target_modules=["q_proj", "down_proj"], exclude_modules=["0.mlp.down_proj"]),
    "all_linear": dict(r=1, lora_alpha=2, target_modules="all-linear"),
    "fan_in_fan_out": dict(r=2, lora_alpha=2, target_modules=["q_proj"], fan_in_fan_out=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_modules_ranks_scalings_match_peft(case, lora_base, make_adapter):
    torch.manual_seed(0)
    d = make_adapter(case, seed=3, **CASES[case])
    info = inspect_adapter_dir(d, lora_base.spec, max_lora_rank=64)
    expected = peft_modules(lora_base.model, d)
    got = {k: (m.rank, m.scaling) for k, m in info.modules.items()}
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k][0] == expected[k][0], k
        assert math.isclose(got[k][1], expected[k][1], rel_tol=1e-12), k
    assert info.rank == max(r for r, _ in expected.values())
    assert set(info.targets) == {m for (_, m) in expected}


def test_content_hash_identity(lora_base, make_adapter, tmp_path):
    torch.manual_seed(0)
    a = make_adapter("a", seed=1)
    same = make_adapter("a_again", seed=1)
    other_weights = make_adapter("b", seed=2)
    assert compute_content_hash(a) == compute_content_hash(same)
    assert compute_content_hash(a) != compute_content_hash(other_weights)
    # a config field that changes the math changes the hash; one that does not, does not
    alpha = edit_config(a, tmp_path / "alpha", lora_alpha=99)
    assert compute_content_hash(alpha) != compute_content_hash(a)
    doc = edit_config(a, tmp_path / "doc", base_model_name_or_path="somewhere/else", lora_dropout=0.3)
    assert compute_content_hash(doc) == compute_content_hash(a)
    # one element changed in one tensor
    def bump(t):
        k = sorted(t)[0]
        t[k] = t[k].clone()
        t[k][0, 0] += 1.0

    assert compute_content_hash(edit_tensors(a, tmp_path / "bump", bump)) != compute_content_hash(a)
    # the header's key order does not matter
    parsed = load_adapter_files(a)
    names = sorted(parsed.tensors, reverse=True)
    header, data, off = {}, b"", 0
    for n in names:
        raw = parsed.tensors[n].contiguous().numpy().tobytes()
        header[n] = {"dtype": "F32", "shape": list(parsed.tensors[n].shape), "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    reordered = copy_adapter(a, tmp_path / "reordered")
    write_safetensors_raw(reordered / "adapter_model.safetensors", header, data)
    assert compute_content_hash(reordered) == compute_content_hash(a)


def test_two_file_form(make_adapter):
    d = make_adapter("two", seed=1)
    both = load_adapter_files(d / "adapter_config.json", d / "adapter_model.safetensors")
    assert both.content_hash == compute_content_hash(d)


# ---------------------------------------------------------------------------------------------
# rejections: each names its problem


def _rejects(path, spec, match, max_rank=64):
    with pytest.raises(InvalidAdapterError, match=match):
        inspect_adapter_dir(path, spec, max_lora_rank=max_rank)


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".pkl"])
def test_rejects_pickle_files(suffix, lora_base, make_adapter, tmp_path):
    d = copy_adapter(make_adapter("p", seed=1), tmp_path / "p")
    # a real pickle that would run code if loaded: it must never be opened
    (d / f"extra{suffix}").write_bytes(b"cos\nsystem\n(S'touch /tmp/loraplex_pwned'\ntR.")
    _rejects(d, lora_base.spec, "pickle")


def test_rejects_vllms_extra_vocabulary_file(lora_base, make_adapter, tmp_path):
    """vLLM's old extra-vocab adapters keep the added tokens' rows in new_embeddings.safetensors
    (vllm-project/vllm#2816), read with --lora-extra-vocab-size: loraplex reserves no extra
    vocabulary, so such an adapter is refused, not served with the file left unread."""
    d = copy_adapter(make_adapter("extra", seed=1), tmp_path / "extra")
    save_file({"input_embeddings": torch.zeros(2, lora_base.spec.hidden_size)}, str(d / "new_embeddings.safetensors"))
    _rejects(d, lora_base.spec, "new_embeddings.safetensors holds embeddings of tokens the adapter adds")


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(use_dora=True), "DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(bias="all"), "bias"),
        (dict(bias="lora_only"), "bias"),
        (dict(r=...), "'r' is missing"),
        (dict(lora_alpha=...), "'lora_alpha' is missing"),
        (dict(target_modules=...), "'target_modules' is missing"),
        (dict(peft_type=...), "'peft_type' is missing"),
        (dict(peft_type="IA3"), "peft_type"),
        (dict(r=0), "r must be a positive integer"),
        (dict(lora_alpha="x"), "lora_alpha"),
        # lm_head is servable now: a config targeting it needs its tensors
        (dict(target_modules=["q_proj", "v_proj", "lm_head"]), "missing tensor lora_A for targeted module 'lm_head'"),
        (dict(target_modules=["q_proj", "v_proj", "fc1"]), "fc1"),
        (dict(layers_to_transform=[5]), "layer 5"),
        (dict(rank_pattern={"[": 2}), "regular expression"),
        # valid alone, but not inside the groups PEFT wraps a rank_pattern key in (a 500 before)
        (dict(rank_pattern={r"(q)(v)?\2": 2}), r"rank_pattern '\(q\)\(v\)\?\\\\2' is not a valid regular expression inside"),
        (dict(alpha_pattern={"(?i)q_proj": 2}), r"alpha_pattern '\(\?i\)q_proj' is not a valid regular expression inside"),
        (dict(lora_alpha=1e300), "scaling"),  # alpha / r beyond float32, where slot scalings live
        (dict(alpha_pattern={"v_proj": -1e300}), "scaling"),
        # finite in float32, but the update would overflow the forward (and poison the KV cache)
        (dict(lora_alpha=1e30), "may reach .* beyond 65504"),
        (dict(alpha_pattern={"q_proj": 1e38}), r"'model.layers.0.self_attn.q_proj': its update .* beyond 65504"),
        (dict(alpha_pattern={"v_proj": -3e6}), r"v_proj': its update \(scaling -.*beyond 65504"),
    ],
)
def test_rejects_config(changes, match, lora_base, make_adapter, tmp_path):
    src = make_adapter("c", seed=1)
    _rejects(edit_config(src, tmp_path / "bad", **changes), lora_base.spec, match)


def test_rejects_config_not_json(lora_base, make_adapter, tmp_path):
    d = copy_adapter(make_adapter("j", seed=1), tmp_path / "j")
    (d / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    _rejects(d, lora_base.spec, "not valid JSON")


def test_rejects_rank_above_max(lora_base, make_adapter):
    _rejects(make_adapter("big", seed=1, r=16, lora_alpha=16), lora_base.spec, "max_lora_rank 8", max_rank=8)


def test_rejects_shapes_for_another_model(lora_base, tmp_path):
    from tests.fixtures.peft_adapters import make_peft_adapter, tiny_llama

    wider = tiny_llama(seed=0, hidden_size=96, intermediate_size=96)
    d = make_peft_adapter(wider, tmp_path / "wider", seed=1, r=2, target_modules=["q_proj"])
    _rejects(d, lora_base.spec, r"shape \[2, 96\], base model needs \[2, 64\]")


def test_rejects_layer_out_of_range(lora_base, tmp_path):
    from tests.fixtures.peft_adapters import make_peft_adapter, tiny_llama

    deeper = tiny_llama(seed=0, num_hidden_layers=3)
    d = make_peft_adapter(deeper, tmp_path / "deeper", seed=1, r=2, target_modules=["q_proj"])
    _rejects(d, lora_base.spec, "layer 2, but the base model has 2 layers")


def test_rejects_missing_and_extra_tensors(lora_base, make_adapter, tmp_path):
    src = make_adapter("t", seed=1, target_modules=["q_proj", "v_proj"])

    def drop(t):
        del t[sorted(k for k in t if "lora_B" in k)[0]]

    _rejects(edit_tensors(src, tmp_path / "missing", drop), lora_base.spec, "missing tensor lora_B")

    def extra_module(t):
        k = next(k for k in t if "q_proj.lora_A" in k)
        t[k.replace("q_proj", "k_proj")] = t[k].clone()
        t[k.replace("q_proj", "k_proj").replace("lora_A", "lora_B")] = torch.zeros(32, 4)

    _rejects(edit_tensors(src, tmp_path / "extra", extra_module), lora_base.spec, "extra tensors .*k_proj")

    def extra_kind(t):
        t["base_model.model.lm_head.weight"] = torch.zeros(2, 2)

    _rejects(edit_tensors(src, tmp_path / "extra2", extra_kind), lora_base.spec, "lm_head")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_rejects_nan_inf(bad, lora_base, make_adapter, tmp_path):
    src = make_adapter("n", seed=1)

    def poison(t):
        k = sorted(t)[-1]
        t[k] = t[k].clone()
        t[k][0, -1] = bad

    _rejects(edit_tensors(src, tmp_path / "nan", poison), lora_base.spec, "NaN or Inf")


def _raw_case(d, kind):
    f = d / "adapter_model.safetensors"
    parsed = load_adapter_files(d)
    names = sorted(parsed.tensors)
    header, data, off = {}, b"", 0
    for n in names:
        raw = parsed.tensors[n].contiguous().numpy().tobytes()
        header[n] = {"dtype": "F32", "shape": list(parsed.tensors[n].shape), "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    if kind == "not_json":
        write_safetensors_raw(f, b"{not json", data)
    elif kind == "oversized":
        write_safetensors_raw(f, json.dumps(header).encode(), data, header_len=200 * 1024 * 1024)
    elif kind == "len_past_end":
        write_safetensors_raw(f, json.dumps(header).encode(), data, header_len=len(json.dumps(header)) + len(data) + 1)
    elif kind == "outside":
        header[names[-1]]["data_offsets"][1] += 1 << 20
        write_safetensors_raw(f, header, data)
    elif kind == "overlap":
        header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])
        write_safetensors_raw(f, header, data)
    elif kind == "bad_dtype":
        header[names[0]]["dtype"] = "I64"
        write_safetensors_raw(f, header, data)
    elif kind == "short":
        f.write_bytes(b"\x01\x02")
    return d


@pytest.mark.parametrize(
    "kind, match",
    [
        ("not_json", "header is not valid JSON"),
        ("oversized", "exceeds the cap"),
        ("len_past_end", "past the end"),
        ("outside", "outside the file"),
        ("overlap", "gap or overlap|spans"),
        ("bad_dtype", "dtype 'I64'"),
        ("short", "shorter than"),
    ],
)
def test_rejects_malformed_safetensors(kind, match, lora_base, make_adapter, tmp_path):
    d = copy_adapter(make_adapter("m", seed=1), tmp_path / "m")
    _rejects(_raw_case(d, kind), lora_base.spec, match)


# JSON that Python's parser refuses with something other than JSONDecodeError: nesting deeper than
# the recursion limit (RecursionError) and an integer over 4300 digits (ValueError)
_DEEP = b"[" * 100_000 + b"]" * 100_000
_LONG_INT = b"1" + b"0" * 5000


@pytest.mark.parametrize("where", ["config", "header"])
@pytest.mark.parametrize("value", [_DEEP, _LONG_INT], ids=["deep", "long_int"])
def test_rejects_json_the_parser_chokes_on(where, value, lora_base, make_adapter, tmp_path):
    d = copy_adapter(make_adapter("deep", seed=1), tmp_path / "deep")
    if where == "config":
        (d / "adapter_config.json").write_bytes(b'{"peft_type": "LORA", "r": ' + value + b"}")
        match = "adapter_config.json: not valid JSON"
    else:
        header = b'{"t": {"dtype": "F32", "shape": [' + value + b'], "data_offsets": [0, 0]}}'
        write_safetensors_raw(d / "adapter_model.safetensors", header)
        match = "header is not valid JSON"
    _rejects(d, lora_base.spec, match)


def test_update_bound_is_the_largest_possible_entry(lora_base, make_adapter, tmp_path):
    """The update check refuses by an upper bound of max |scaling * B @ A| (row norms of B times
    column norms of A): an update whose largest entry lies just under the limit loads, one just
    over it is refused, and the bound never lies below the true largest entry."""
    from loraplex.lora.peft_format import MAX_UPDATE_ENTRY, check_update_bound

    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        a, b = torch.randn(4, 64, generator=gen), torch.randn(96, 4, generator=gen)
        largest = float((b @ a).abs().max())
        check_update_bound("m", a, b, 0.999 * MAX_UPDATE_ENTRY / largest / 4)  # bound <= 4 x largest here
        with pytest.raises(InvalidAdapterError, match="beyond 65504"):
            check_update_bound("m", a, b, 1.001 * MAX_UPDATE_ENTRY / largest)
    # a single entry: the bound is exact
    check_update_bound("m", torch.tensor([[2.0]]), torch.tensor([[3.0]]), MAX_UPDATE_ENTRY / 6)
    with pytest.raises(InvalidAdapterError):
        check_update_bound("m", torch.tensor([[2.0]]), torch.tensor([[3.0]]), MAX_UPDATE_ENTRY / 5.99)


# backtracks without bound on a module name: Python's re takes minutes holding the GIL
# (named groups: rank_pattern's keys are wrapped in groups of PEFT's, which would shift numbers)
SLOW_PATTERN = ("(?P<a>.*(?P<b>.*(?P<c>.*(?P<d>.*(?P<e>.*(?P<f>.*(?P<g>.*(?P<h>.*)(?P=h))(?P=g))(?P=f))(?P=e))"
                "(?P=d))(?P=c))(?P=b))(?P=a)l")


@pytest.mark.parametrize("changes", [
    dict(target_modules=SLOW_PATTERN),
    dict(exclude_modules=SLOW_PATTERN),
    dict(rank_pattern={SLOW_PATTERN: 2}),
    dict(alpha_pattern={SLOW_PATTERN: 2}),
    dict(layers_to_transform=[0], layers_pattern=[SLOW_PATTERN]),
])
def test_a_config_pattern_that_backtracks_without_bound_is_refused_promptly(changes, lora_base, make_adapter,
                                                                           tmp_path):
    """An uploader's regular expression that would hold a server thread (and, with re, the GIL)
    for minutes is refused within a fraction of a second, naming its field."""
    import time

    field = next(iter(changes)) if "layers_pattern" not in changes else "layers_pattern"
    started = time.monotonic()
    _rejects(edit_config(make_adapter("c", seed=1), tmp_path / "slow", **changes), lora_base.spec,
             f"{field} .* takes too long to match a module name")
    assert time.monotonic() - started < 5.0


def test_config_patterns_match_as_re_does():
    """The time-limited matching (``regex``) answers as PEFT's ``re`` on the patterns PEFT users
    write."""
    from loraplex.lora import config_patterns

    keys = [f"model.layers.{i}.{m}" for i in (0, 1, 12) for m in ("self_attn.q_proj", "mlp.down_proj", "mlp.up_proj")]
    patterns = [r".*\.0\.self_attn\.(q|v)_proj|.*\.1\.mlp\.up_proj", r".*(q_proj|down_proj)$",
                r"model\.layers\.\d+\.mlp\..*", r"(?:.*\.)?layers\.1\d?\..*", r"(?i).*Q_PROJ"]
    for pattern in patterns:
        for key in keys:
            assert config_patterns.fullmatch("target_modules", pattern, key) == (re.fullmatch(pattern, key) is not None)
            built = rf"(.*\.)?({pattern})$"
            if pattern.startswith("(?i)"):  # re refuses a global flag inside PEFT's groups: no rank_pattern key
                continue
            got = config_patterns.match("rank_pattern", built, pattern, key)
            assert (got is None) == (re.match(built, key) is None)


@pytest.mark.parametrize("spelling", ["ALL-LINEAR", "All-Linear"])
def test_all_linear_in_any_case_is_peft_s_shorthand(spelling, lora_base, make_adapter, tmp_path):
    """PEFT lower-cases ``target_modules`` before it compares it with ``all-linear``; loraplex
    read another case as a regular expression that matched no module (a misleading 400)."""
    src = make_adapter("lin", seed=2, target_modules="all-linear")  # PEFT saves the list it expanded
    want = inspect_adapter_dir(edit_config(src, tmp_path / "lower", target_modules="all-linear"), lora_base.spec,
                               max_lora_rank=64)
    got = inspect_adapter_dir(edit_config(src, tmp_path / "case", target_modules=spelling), lora_base.spec,
                              max_lora_rank=64)
    assert got.modules == want.modules and got.targets == want.targets
    assert got.content_hash == want.content_hash  # one shorthand, one identity
