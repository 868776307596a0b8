"""Text and chat in Python on a real model (SmolLM2-135M-Instruct, from its GGUF): the
folder's tokenizer and chat template, text streamed as it decodes, and the tokens those
give equal to plain ORT's greedy loop (and to transformers' generate, where torch is
installed)."""
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder
from conftest import CHILD_CWD, child_env

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def session(smollm2):
    with OffloadSession(smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def plain(smollm2):
    """Plain ORT's greedy loop on the folder's model.onnx: (ids [n]) -> new ids, up to EOS."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    s = ort.InferenceSession(os.path.join(smollm2, "model.onnx"), so, providers=["CPUExecutionProvider"])
    layers = sum(1 for i in s.get_inputs() if i.name.endswith(".key"))

    def run(ids, n, eos=2):
        past = {f"past_key_values.{i}.{k}": np.zeros((1, 3, 0, 64), np.float32)
                for i in range(layers) for k in ("key", "value")}
        x, total, out = np.array([ids], np.int64), len(ids), []
        for _ in range(n):
            r = s.run(None, dict(input_ids=x, attention_mask=np.ones((1, total), np.int64),
                                 position_ids=np.arange(total - x.shape[1], total)[None], **past))
            token = int(r[0][0, -1].argmax())
            out.append(token)
            if token == eos:
                break
            past = {f"past_key_values.{i}.{k}": r[1 + 2 * i + (k == "value")]
                    for i in range(layers) for k in ("key", "value")}
            x, total = np.array([[token]]), total + 1
        return out
    return run


def template_ids(s, messages):
    from onnx_offload.generation.text_steps import chat_prompt
    return [int(t) for t in chat_prompt(s, messages)[0]]


def test_chat_answers_a_known_question_with_plain_ort_s_greedy_tokens_and_ends_at_eos(session, plain):
    tm = session.text_model
    ids = template_ids(session, QUESTION)
    assert tm.decode(ids[:3]) == "system\n"  # the template's own <|im_start|>system, its special token skipped
    assert ids[0] == tm.tokenizer.token_to_id("<|im_start|>")
    want = plain(ids, 40)
    assert want[-1] == 2 and len(want) < 40  # <|im_end|> ends the reply before the limit
    reply = session.chat(QUESTION, 40)
    assert reply == tm.decode(want[:-1])
    assert "Paris" in reply
    assert "".join(session.chat_iter(QUESTION, 40)) == reply


def test_text_prompts_give_plain_ort_s_text_and_a_batch_gives_each_row_s(session, plain):
    tm = session.text_model
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    wants = [tm.decode(plain(tm.encode(p), 6)) for p in prompts]
    assert session.generate(prompts[0], 6) == wants[0]
    assert session.generate(prompts, 6) == wants  # left-padded rows of different lengths
    steps = list(session.generate_iter(prompts, 6))
    assert len(steps) == 6 and all(isinstance(step, list) and len(step) == 2 for step in steps)
    assert ["".join(row) for row in zip(*steps)] == wants
    ids = np.array([tm.encode(prompts[0])])
    out = session.generate(ids, 6)  # ids in, ids out, as before
    assert out.dtype == np.int64 and tm.decode(out[0, ids.shape[1]:]) == wants[0]


def test_streamed_text_holds_back_a_character_until_its_bytes_are_whole(session):
    messages = [{"role": "user", "content": "Say hello in Japanese."}]
    pieces = list(session.chat_iter(messages, 12))
    tokens = session.generate(np.array([template_ids(session, messages)]), 12)[0, len(template_ids(session, messages)):]
    tm = session.text_model
    multi = [t for t in tokens if "\ufffd" in tm.decode([t])]
    assert multi, "the reply should hold a character split over tokens"
    assert "".join(pieces) == tm.decode(tokens)
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # the step whose token ends inside a character gives no text yet


def test_bad_messages_and_a_model_without_template_or_tokenizer_are_clear_errors(session, tmp_path):
    with pytest.raises(TypeError, match="non-empty list"):
        session.chat([], 4)
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        session.chat([{"role": "user"}], 4)
    with pytest.raises(ValueError, match="attention_mask goes with token ids"):
        session.generate_iter("hi", 2, attention_mask=[1])
    with pytest.raises(ValueError, match=r"lone surrogate '\\ud800' at index 3"):
        session.generate("hi \ud800", 2)
    with pytest.raises(ValueError, match="lone surrogate"):
        session.chat([{"role": "user", "content": "\udfff"}], 2)
    assert session.chat(QUESTION, 3)  # the session goes on
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    assert session.chat(parts, 6, do_sample=False) == session.chat(QUESTION, 6, do_sample=False)
    with pytest.raises(TypeError, match=r"messages\[0\] must be .* text parts"):
        session.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], 2)
    folder = str(tmp_path / "tiny")
    save_decoder(decoder_lm("gqa", vocab=97), folder, genai_config(2, 64, 4, 2, 97, 128))
    with OffloadSession(folder) as s:
        with pytest.raises(FileNotFoundError, match="tokenizer.json"):
            s.generate("hello", 2)
        assert s.generate(np.array([[1, 2, 3]]), 2).shape == (1, 5)
    with OffloadSession(decoder_lm("standard").SerializeToString()) as s:
        with pytest.raises(ValueError, match="made from bytes"):
            s.generate(["hello"], 2)
    import shutil
    shutil.copy(os.path.join(session.model_folder, "tokenizer.json"), folder)
    with OffloadSession(os.path.join(folder, "model.onnx")) as s:
        with pytest.raises(ValueError, match="no chat template"):
            s.chat(QUESTION, 2)


def test_without_the_llm_extra_the_error_names_it(smollm2):
    """A fresh interpreter where `tokenizers` cannot be imported."""
    code = ("import sys; sys.modules['tokenizers'] = None\n"
            "from onnx_offload import OffloadSession\n"
            f"s = OffloadSession({smollm2!r})\n"
            "try:\n    s.generate('hi', 2)\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=child_env(), cwd=CHILD_CWD)
    assert "ERR text and chat need the 'tokenizers' package, of onnx-offload's [llm] extra" in out.stdout, out.stderr


def test_greedy_text_equals_transformers_generate_on_the_same_weights(session, smollm2):
    """transformers' own generate on the GGUF the folder was made from (its loader undoes
    llama.cpp's Q/K permutation and dequantizes), fed the same ids."""
    torch = pytest.importorskip("torch", reason="transformers' generate needs torch (not in the [test] extra)")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads a GGUF through accelerate")
    from onnx_offload.models.gguf_llama import SMOLLM2_GGUF, smollm2_cache
    cache = smollm2_cache()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(cache, os.path.dirname(SMOLLM2_GGUF)),
                                                              gguf_file=os.path.basename(SMOLLM2_GGUF),
                                                              dtype=torch.float32)
    for messages in (QUESTION, [{"role": "user", "content": "Write a haiku about the sea."}]):
        ids = template_ids(session, messages)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=2,
                                 pad_token_id=2)
        theirs = [int(t) for t in out[0, len(ids):]]
        ours = [int(t) for t in session.generate(np.array([ids]), 24, eos_token_id=2)[0, len(ids):]]
        assert ours[:len(theirs)] == theirs
        assert session.chat(messages, 24) == session.text_model.decode([t for t in theirs if t != 2])


def test_unpermute_undoes_llama_cpp_s_rotary_permutation_and_given_weights_are_checked():
    from onnx_offload.models.gguf_llama import unpermute

    def llama_cpp_permute(w, heads):  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    for heads in (1, 3, 6):
        assert not np.array_equal(llama_cpp_permute(w, heads), w)
        np.testing.assert_array_equal(unpermute(llama_cpp_permute(w, heads), heads), w)
    with pytest.raises(ValueError, match="missing .*unknown"):
        decoder_lm("standard", weights={"embed": np.zeros((97, 64), np.float32)})
    model = decoder_lm("standard", layers=1)
    weights = {t.name: np.zeros(t.dims, np.float32) for t in model.graph.initializer if len(t.dims) == 2
               and not t.name.startswith(("cos", "sin"))}
    weights.update({t.name: np.ones(t.dims, np.float32) for t in model.graph.initializer if t.name.endswith("norm")})
    weights["lm_head"] = np.zeros((97, 64), np.float32)
    with pytest.raises(ValueError, match=r"weight lm_head has shape \[97, 64\], the decoder's is \[64, 97\]"):
        decoder_lm("standard", layers=1, weights=weights)


def test_a_template_has_the_globals_transformers_gives_it(session):
    """Llama 3.1's and 3.2's templates date their system message with strftime_now."""
    import datetime
    from onnx_offload.generation import TextModel
    tm = TextModel(session.model_folder)
    tm.template, tm._compiled = "{{ strftime_now('%Y') }} {{ messages[0]['content'] | tojson }}", None
    assert tm.render([{"role": "user", "content": "é"}]) == f'{datetime.date.today().year} "é"'


@pytest.mark.parametrize("template,needle", [
    ("{% raise_exception('no') %}", "cannot be read by jinja2: TemplateSyntaxError: .*unknown tag"),
    ("{{ raise_exception('this template takes no system message') }}",
     "failed on these messages: this template takes no system message"),
])
def test_a_chat_template_that_does_not_parse_or_raises_is_a_clear_error(tmp_path, template, needle):
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "make_model", os.path.join(os.path.dirname(__file__), "..", "models", "make_model.py"))
    make_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_model)
    folder = str(tmp_path / "tiny")
    save_decoder(decoder_lm("gqa", vocab=97), folder, genai_config(2, 64, 4, 2, 97, 128))
    make_model.write_tokenizer(folder, 97)
    (tmp_path / "tiny" / "chat_template.jinja").write_text(template)
    with OffloadSession(folder) as s:
        for _ in range(2):  # the second call meets the same template, and the same error
            with pytest.raises(ValueError, match=needle):
                s.chat([{"role": "user", "content": "w1"}], 2)
        assert isinstance(s.generate("w1 w2", 2), str)  # the session goes on


def test_cli_generate_prints_the_text_of_python_s_generate_characters_split_over_tokens_whole(session, capsys):
    """Each of these emoji decodes from three byte tokens: the text a step completes prints
    whole, not as replacement characters."""
    from onnx_offload.tools.cli import main
    prompt = "Say 😀🎉 日本語"
    want = session.generate(prompt, 8, do_sample=False)
    assert "🎉" in want
    assert main(["generate", session.model_folder, "--prompt", prompt, "--max-new-tokens", "8", "--cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == want
