"""``loraplex generate``: the offline demo prints what the LLM API generates."""

from __future__ import annotations

from loraplex.cli import main
from loraplex.engine.llm import LLM
from loraplex.sampling_params import SamplingParams


def test_generate_command_prints_llm_output(tiny_llama_dir, loraplex_home, monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_HOME", str(loraplex_home))
    monkeypatch.setenv("LORAPLEX_KV_CACHE_BYTES", str(1 << 20))
    rc = main(["generate", "--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
               "--prompt", "hello", "--prompt", "capital of", "--max-tokens", "6", "--chat"])
    assert rc == 0
    printed = capsys.readouterr().out
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", home=loraplex_home, kv_cache_bytes=1 << 20)
    tok = llm.get_tokenizer()
    chats = [
        tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False)["input_ids"]
        for p in ("hello", "capital of")
    ]
    expected = llm.generate(chats, SamplingParams(temperature=0.0, max_tokens=6))
    for prompt, out in zip(("hello", "capital of"), expected):
        block = f"### {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]"
        assert block in printed


def test_generate_command_rejects_bad_option(tiny_llama_dir, loraplex_home, monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_HOME", str(loraplex_home))
    monkeypatch.setenv("LORAPLEX_KV_CACHE_BYTES", str(1 << 20))
    rc = main(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--max-tokens", "0"])
    assert rc == 2
    assert "max_tokens" in capsys.readouterr().err


def test_generate_names_a_model_that_is_not_there_in_one_line(loraplex_home, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LORAPLEX_HOME", str(loraplex_home))
    rc = main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --model: ") and "not found" in err and err.count("\n") == 1, err
