"""The commands that run the user's model: `run` (steps on given or random feeds, with the
offload counters, step times and the residency timeline) and `generate` (tokens from a
decoder, streamed as they come).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from ..errors import BudgetExceeded
from .cli_args import (DEVICE_ENTRY, PER_DEVICE_FLAGS, check_config_flags, check_feeds, config_kwargs, device_kind,
                       flag_list, load_feeds, load_tokenizer, make_feeds, parse_prompt_ids, per_device, provider)
from .cli_report import generation_lines


def cmd_run(args) -> int:
    from ..session import OffloadSession
    check_config_flags(args)  # everything the arguments allow is checked before any weight loads
    feeds = load_feeds(args.inputs) if args.inputs else None
    kind = device_kind(args)
    kw = config_kwargs(args)
    kw["record_timeline"] = bool(args.timeline)
    with OffloadSession(args.model, providers=[provider(kind)], **kw) as s:
        if feeds is not None:
            check_feeds(feeds, s.get_inputs())
        elif s._decoder_spec is not None and not isinstance(s._decoder_spec, Exception):
            # Random feeds with every free dimension 1 are no step of a decoder (a past of
            # one position beside a mask of one): ORT fails in its attention.
            raise ValueError(f"{args.model} is a decoder with a KV cache: generate tokens with 'onnx-offload "
                             f"generate {args.model} --prompt-ids 1,2,3', or give the feeds of a step with --inputs "
                             f"FEEDS.npz")
        else:
            feeds = make_feeds(s.get_inputs())
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            s.run(None, feeds)
            times.append((time.perf_counter() - t0) * 1e3)
        print(s.stats())
        if args.profile:
            print(f"\nstep time: median {statistics.median(times):.2f} ms, first {times[0]:.2f} ms, "
                  f"min {min(times):.2f} ms over {len(times)} steps")
            print("segments: " + ", ".join(f"{i}:{len(seg.weights)}w" for i, seg in enumerate(s.segments)))
        if args.timeline:
            print(f"residency timeline: {s.timeline_png(args.timeline)}")
    return 0


def _advice_for(error, model: str, provider_name: str, kw: dict, ids: np.ndarray, new: int):
    """The error of a budget too small for the session, with advice that also holds this
    generation's KV cache and step buffers (generation.advice): the command knows its
    generation, so the budget the session needs is tried with it, and one round of
    advice runs. Where the arguments cannot run at any budget, their error is given."""
    from ..generation import with_generation
    from ..generation.sampling import check_generate_args
    from ..session import OffloadSession
    batch, prompt = ids.shape
    return with_generation(error, lambda **budget: OffloadSession(model, providers=[provider_name], **{**kw, **budget}),
                           batch, prompt, prompt + max(new - 1, 0), "this generation",
                           check=lambda probe: check_generate_args(probe, ids, new, None))


def _staged_session(model: str, provider_name: str, kw: dict, ids: np.ndarray, new: int):
    """With --devices (two or more): the session, once this generation's caches were
    allocated on every device at their last size (and given back). A staged shortage
    names one device's entry of a budget flag at a time; each is tried in turn, every
    device's, and the advice given is what ran, in this command's flags: one round
    (devices.advice). The probe's warnings are the user's only where the flags given
    hold the generation."""
    import warnings
    from ..devices.advice import follow, hold_generation, reason
    from ..generation.sampling import check_generate_args
    from ..session import OffloadSession
    devices, (batch, prompt) = kw["devices"], ids.shape
    total = prompt + max(new - 1, 0)

    def use(s):
        check_generate_args(s, ids, new, None)  # arguments no budget mends are said first
        hold_generation(s, batch, prompt, total)

    got = follow(lambda **tried: OffloadSession(model, providers=[provider_name], **tried), devices, kw, use)
    said = got.said(devices, flag_list)
    if got.session is None:
        if got.last is got.first:
            raise got.first
        raise BudgetExceeded(f"{reason(got.first)}; with {said} this generation still fell short: "
                             f"{reason(got.last)}") from None
    if got.first is None:
        for w in got.noted:  # the flags given hold it: the session's warnings are the user's
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        return got.session
    got.session.close()
    raise BudgetExceeded(f"{reason(got.first)}; tried with this generation ({batch} x {prompt} tokens, {new} new) "
                         f"on every device, these flags hold it: pass {said}") from None


def cmd_generate(args) -> int:
    from ..session import OffloadSession
    check_config_flags(args)
    if not os.path.exists(args.model):
        raise FileNotFoundError(f"{args.model!r}: no such model file or folder")
    from ..generation import SAMPLING_DEFAULTS, Sampling
    from .cli_chat import given_sampling
    given = given_sampling(args)
    # Checked before any weight loads; what is not given is the model's, read once it loads.
    Sampling(**{k: SAMPLING_DEFAULTS[k] if v is None else v for k, v in given.items()})
    eos = None
    if args.eos_token_id is not None:
        try:
            eos = [int(t) for t in args.eos_token_id.split(",") if t.strip()]
            if not all(0 <= t < 2**63 for t in eos):
                raise ValueError
        except ValueError:
            raise ValueError(f"--eos-token-id {args.eos_token_id!r}: expected token ids (integers from 0 to 2**63 - 1) "
                             f"separated by commas") from None
    tok = None
    if args.prompt is not None:
        from ..generation import TextModel
        load_tokenizer(args.model)  # tokenizer.json checked, with --prompt's own errors
        # encoded as generate("...") encodes it, and its text streamed as the row decodes
        tok = TextModel(args.model if os.path.isdir(args.model) else os.path.dirname(os.path.abspath(args.model)))
        ids = np.array([tok.encode(args.prompt)], np.int64)
        if ids.shape[1] == 0:
            raise ValueError("--prompt encodes to no tokens")
    else:
        ids = parse_prompt_ids(args.prompt_ids)
    kind = device_kind(args)
    kw = config_kwargs(args)
    from ..generation import own_probe
    if len(kw.get("devices") or ()) > 1:
        s = _staged_session(args.model, provider(kind), kw, ids, args.max_new_tokens)
    else:
        try:
            with own_probe():  # the advice of a budget too small is tried with this generation, below
                s = OffloadSession(args.model, providers=[provider(kind)], **kw)
        except BudgetExceeded as e:
            raise _advice_for(e, args.model, provider(kind), kw, ids, args.max_new_tokens) from None
    with s:
        spec = s.decoder_spec  # an unsupported model fails here, before any step
        t0 = time.perf_counter()
        new, first = [], None
        shown = ""
        # One row's tokens print as they come (the text, with --prompt; else the ids);
        # a batch's rows print at the end. Ctrl-C keeps what came.
        stream = tok is None and len(ids) == 1
        # generate_iter checks its arguments when called: a bad one is said before any output.
        steps = s.generate_iter(ids, args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=eos)
        if stream:
            print("tokens: ", end="", flush=True)
        text = tok.stream() if tok is not None else None
        ended, stop = False, set(int(e) for e in (spec.eos_token_id if eos is None else eos))
        try:
            for step in steps:
                if first is None:
                    first = time.perf_counter() - t0
                new.append(step)
                if tok is not None:  # the text up to the EOS; a character split over tokens prints whole
                    ended = ended or int(step[0]) in stop
                    piece = "" if ended else text.step(int(step[0]))
                    print(piece, end="", flush=True)
                    shown += piece
                elif stream:
                    print(("," if len(new) > 1 else "") + str(int(step[0])), end="", flush=True)
        except KeyboardInterrupt:
            print()
            if not stream:
                for row in (np.stack(new, axis=1) if new else np.zeros((len(ids), 0), np.int64)):
                    print("tokens: " + ",".join(str(int(t)) for t in row))
            print(f"onnx-offload: interrupted after {len(new)} new tokens", file=sys.stderr)
            return 130
        except BaseException:
            if stream or shown:  # the error goes on a line of its own, after the tokens that came
                print(flush=True)
            raise
        elapsed = time.perf_counter() - t0
        if tok is not None or stream:
            print()
        tokens = np.stack(new, axis=1) if new else np.zeros((len(ids), 0), np.int64)
        if not stream:
            for row in tokens:
                print("tokens: " + ",".join(str(int(t)) for t in row))
        decode = elapsed - (first or 0)
        n = tokens.shape[1]
        rate = (n - 1) / decode if n > 1 and decode > 0 else float("nan")
        print(f"{n} new tokens x batch {len(ids)} in {elapsed:.3f} s: prompt {1e3 * (first or 0):.1f} ms, "
              f"{rate:.1f} tokens/s after it ({spec.layout} layout, {len(s.segments)} segment(s), "
              f"graphs {'on' if s.graph_capture.enabled else 'off'})")
        # One device (a split model's stages report their own stats()): reported once the
        # session has given its memory back, as the link's measurement takes some.
        report = None if hasattr(s, "stages") else (s.device.kind, s.config.device_id, s.stats())
    if report is not None:
        for line in generation_lines(*report, decode_ms=1e3 * decode / (n - 1) if n > 1 else None):
            print(line)
    return 0
