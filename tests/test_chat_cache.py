"""chat() keeps the KV cache across turns: a later turn feeds only the tokens its rendering
adds, and its reply equals recomputing the whole conversation. Random-weight decoders of
each layout with SmolLM2's tokenizer and chat template (its vocabulary's size)."""
import os
import shutil
import signal

import numpy as np
import pytest

from onnx_offload import OffloadSession
from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder

VOCAB = 49152  # SmolLM2's tokenizer
NEW = 6


@pytest.fixture(scope="module", params=["gqa", "standard", "exact"])
def folder(request, smollm2, tmp_path_factory):
    layout = request.param
    out = str(tmp_path_factory.mktemp(layout))
    model = decoder_lm("gqa" if layout == "gqa" else "standard", vocab=VOCAB, max_length=512,
                       position_ids=layout != "exact")
    save_decoder(model, out, genai_config(2, 64, 4, 2, VOCAB, 512, layout="gqa" if layout == "gqa" else "standard"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(smollm2, name), out)
    return out


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Fed:
    """Counts the tokens each step of a session feeds (its input_ids' lengths)."""

    def __init__(self, s):
        self.lengths, run = [], s._run_bound

        def counted(feeds, outputs, **kw):
            self.lengths.append(feeds["input_ids"].shape()[1])
            return run(feeds, outputs, **kw)
        s._run_bound = counted


def ids_of(s, messages):
    from onnx_offload.generation.text_steps import chat_prompt
    return [int(t) for t in chat_prompt(s, messages)[0]]


def recomputed(ref, ids, new=NEW):
    """The new tokens of the whole conversation run as one prompt, up to EOS."""
    out = [int(t) for t in ref.generate(np.array([ids]), new, eos_token_id=2)[0, len(ids):]]
    return out[:out.index(2) + 1] if 2 in out else out


def test_a_later_turn_feeds_only_its_new_tokens_and_replies_as_recomputing_the_conversation(folder):
    with OffloadSession(folder, prefill_chunk=8) as s, OffloadSession(folder, prefill_chunk=8) as ref:
        assert s.decoder_spec.layout == os.path.basename(folder).rstrip("0123456789")
        tm, fed = s.text_model, Fed(s)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        cached, turns = [], []
        for turn, question in enumerate(["And of Germany?", "Name a river there, please.", "Thanks!"]):
            ids = ids_of(s, messages)
            want = recomputed(ref, ids)
            fed.lengths.clear()
            reply = s.chat(messages, NEW, eos_token_id=2)
            assert reply == tm.decode([t for t in want if t != 2])
            reused = common_prefix(cached, ids) if turn else 0
            if turn == 1:  # the conversation so far stays in the cache
                assert reused == len(cached)
            if turn == 2:
                assert len(ids_of(s, messages[:-2])) <= reused < len(cached)
            # the exact layout's cache is not cut back: the conversation runs whole
            cut = s.decoder_spec.layout == "exact" and reused < len(cached)
            if cut:
                reused = 0
            # the prompt's steps feed the new tokens alone (in chunks of 8), then one a step
            split = len(fed.lengths) - (len(want) - 1)
            prompt_steps, decode_steps = fed.lengths[:split], fed.lengths[split:]
            assert sum(prompt_steps) == len(ids) - reused and max(prompt_steps) <= 8
            assert decode_steps == [1] * (len(want) - 1)
            turns.append((getattr(s, "last_chat", None), reused, len(ids) - reused, cut))
            cached = ids + want[:-1]
            # the second reply goes back edited (as a template that strips it would render
            # it): the cache is cut back where the renderings part
            said = reply if turn != 1 else "Well," + reply
            messages += [{"role": "assistant", "content": said}, {"role": "user", "content": question}]
        for said, reused, new, cut in turns:  # what last_chat told of each turn
            assert said == (reused, new, said.note)
            assert ("cut back" in said.note) if cut else said.note is None


def test_ctrl_c_in_a_reply_keeps_what_was_fed_and_the_next_turn_equals_recomputing(folder, ctrl_c):
    with OffloadSession(folder, prefill_chunk=8) as s, OffloadSession(folder, prefill_chunk=8) as ref:
        messages = [{"role": "user", "content": "Tell me a story."}]
        ids = ids_of(s, messages)
        pieces, decoded, run = [], [], s._run_bound

        def interrupted(feeds, outputs, **kw):  # Ctrl-C during the third decode step
            if pieces:
                decoded.append(feeds["input_ids"].shape()[1])
                if len(decoded) == 3:
                    signal.raise_signal(signal.SIGINT)
            return run(feeds, outputs, **kw)
        s._run_bound = interrupted
        with pytest.raises(KeyboardInterrupt):
            for piece in s.chat_iter(messages, 40, eos_token_id=2):
                pieces.append(piece)
        s._run_bound = run
        want = recomputed(ref, ids, 40)
        assert len(pieces) == 3 and decoded == [1, 1, 1]
        # the step Ctrl-C arrived in ran whole: the prompt and three tokens are in the cache
        assert s._chat.ids == ids + want[:3]
        messages += [{"role": "assistant", "content": "".join(pieces)}, {"role": "user", "content": "Go on."}]
        ids = ids_of(s, messages)
        reply = s.chat(messages, NEW, eos_token_id=2)
        assert reply == tm_text(s, recomputed(ref, ids))
        if s.last_chat.note is None:
            assert s.last_chat.reused == common_prefix(ids_of(s, messages[:1]) + want[:3], ids) > 0
        # a caller that stops early keeps the cache too; a new conversation starts afresh
        first = next(iter(s.chat_iter(messages, NEW, eos_token_id=2)))
        assert isinstance(first, str) and s._chat is not None
        other = [{"role": "user", "content": "Hi"}]
        assert s.chat(other, NEW, eos_token_id=2) == tm_text(s, recomputed(ref, ids_of(s, other)))
        assert s.last_chat.reused <= len(ids_of(s, other))
        s.free_generation_cache()
        assert s._chat is None


def tm_text(s, tokens):
    return s.text_model.decode([t for t in tokens if t != 2])


def test_the_real_model_s_second_turn_keeps_the_first_in_the_cache_and_answers_as_recomputing(smollm2):
    with OffloadSession(smollm2) as s:
        fed = Fed(s)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        first = s.chat(messages, 40)
        assert "Paris" in first
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And of Germany?"}]
        ids = ids_of(s, messages)
        fed.lengths.clear()
        second = s.chat(messages, 40)
        steps = list(fed.lengths)
        want = recomputed(s, ids, 40)
        assert "Berlin" in second and second == tm_text(s, want)
        # the first turn and its reply stay: the new user turn alone is fed, in one step
        reused = len(ids_of(s, messages[:1])) + len(s.text_model.encode(first, False))
        assert steps == [len(ids) - reused] + [1] * (len(want) - 1) and len(ids) - reused < 20
        assert s.last_chat == (reused, len(ids) - reused, None)


def tiny(root, smollm2, **kw):
    model = decoder_lm("gqa", vocab=VOCAB, **kw)
    save_decoder(model, root, genai_config(2, 64, 4, 2, VOCAB, kw.get("max_length", 128)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(smollm2, name), root)
    return root


def test_a_conversation_past_its_planned_cache_or_on_window_caches_runs_whole_and_says_why(smollm2, tmp_path):
    from onnx_offload.generation.loop import FIRST_CONTEXT
    folder = tiny(str(tmp_path / "long"), smollm2, max_length=4 * FIRST_CONTEXT)
    with OffloadSession(folder, prefill_chunk=256) as s, OffloadSession(folder, prefill_chunk=256) as ref:
        messages = [{"role": "user", "content": "Hello there."}]
        reply = s.chat(messages, NEW, eos_token_id=2)
        planned = s._chat.total
        assert planned == FIRST_CONTEXT
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "Count: " + " ".join(str(i % 10) for i in range(FIRST_CONTEXT // 2))}]
        ids = ids_of(s, messages)
        assert len(ids) > planned
        assert s.chat(messages, NEW, eos_token_id=2) == tm_text(s, recomputed(ref, ids))
        assert s.last_chat[:2] == (0, len(ids)) and f"more than the {planned} its cache" in s.last_chat.note
        assert s._chat.total >= 2 * len(ids)
    folder = tiny(str(tmp_path / "window"), smollm2, window_cache=8)
    with OffloadSession(folder) as s, OffloadSession(folder) as ref:
        messages = [{"role": "user", "content": "Hello there."}]
        for turn in range(2):
            ids = ids_of(s, messages)
            reply = s.chat(messages, NEW, eos_token_id=2)
            assert reply == tm_text(s, recomputed(ref, ids))
            assert s.last_chat == (0, len(ids), "each turn runs the whole conversation again: its window-sized "
                                                "caches evict positions")
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
        assert s._chat is None


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["resident", "a third"])
@pytest.mark.parametrize("capture", [None, False])
def test_on_cuda_a_later_turn_feeds_only_its_new_tokens_and_replies_as_recomputing(folder, weights, capture):
    kw = dict(providers=["CUDAExecutionProvider"], vram_limit="2GiB", cuda_graph=capture, prefill_chunk=8)
    if weights == "a third":  # the weights stream through a third of their size
        kw.update(offload=True, vmm=True, weight_bytes=os.path.getsize(os.path.join(folder, "model.onnx.data")) // 3)
    with OffloadSession(folder, **kw) as s, OffloadSession(folder, **kw) as ref:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        cached = []
        for turn, question in enumerate(["And of Germany?", "Name a river there, please."]):
            ids = ids_of(s, messages)
            want = recomputed(ref, ids, 12)
            assert s.chat(messages, 12, eos_token_id=2) == tm_text(s, want)
            reused = common_prefix(cached, ids) if turn else 0
            assert s.last_chat == (reused, len(ids) - reused, None) and (reused == len(cached))
            cached = ids + want[:-1]
            messages += [{"role": "assistant", "content": tm_text(s, want)}, {"role": "user", "content": question}]


def test_ctrl_c_while_a_turn_feeds_its_tokens_keeps_the_pieces_fed(folder, ctrl_c):
    with OffloadSession(folder, prefill_chunk=8) as s, OffloadSession(folder, prefill_chunk=8) as ref:
        messages = [{"role": "user", "content": "Hello there."}]
        reply = s.chat(messages, NEW, eos_token_id=2)
        before = list(s._chat.ids)
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "Tell me about rivers, lakes and the sea, please."}]
        ids = ids_of(s, messages)
        reused = common_prefix(before, ids)
        assert len(ids) - reused > 16  # three pieces at least
        pieces, run = [], s._run_bound

        def interrupted(feeds, outputs, **kw):  # Ctrl-C during the second piece
            pieces.append(feeds["input_ids"].shape()[1])
            if len(pieces) == 2:
                signal.raise_signal(signal.SIGINT)
            return run(feeds, outputs, **kw)
        s._run_bound = interrupted
        with pytest.raises(KeyboardInterrupt):
            s.chat(messages, NEW, eos_token_id=2)
        s._run_bound = run
        whole = s.decoder_spec.layout == "exact" and reused < len(before)
        if whole:  # not cut back: the prompt ran whole, its chunks one step that Ctrl-C waits for
            assert s._chat.ids == ids
        else:  # the continued prompt's pieces are steps of their own
            assert pieces == [8, 8] and s._chat.ids == ids[:reused + 16]
        # the next turn goes on after what was fed, and replies as recomputing
        assert s.chat(messages, NEW, eos_token_id=2) == tm_text(s, recomputed(ref, ids))
        if whole:
            assert s.last_chat[:2] == (0, len(ids)) and "cut back" in s.last_chat.note
        else:
            assert s.last_chat == (reused + 16, len(ids) - reused - 16, None)


def test_a_model_split_across_devices_runs_each_turn_whole_and_says_so(smollm2, tmp_path):
    folder = tiny(str(tmp_path / "split"), smollm2)
    with OffloadSession(folder, providers=["CPUExecutionProvider"], devices=[0, 1], host_granularity=4096) as s, \
            OffloadSession(folder) as ref:
        assert s.last_chat is None
        messages = [{"role": "user", "content": "Hello there."}]
        for turn in range(2):
            ids = ids_of(s, messages)
            reply = s.chat(messages, NEW, eos_token_id=2)
            assert reply == tm_text(s, recomputed(ref, ids))
            assert s.last_chat == (0, len(ids), "each turn runs the whole conversation again: the model is split "
                                                "across devices")
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
