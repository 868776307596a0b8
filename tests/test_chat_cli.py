"""`onnx-offload chat` on the real model (SmolLM2-135M-Instruct), driven through a
pseudo-terminal as a user types: two turns, Ctrl-C during a reply, a third turn; each turn
after the first feeds only the tokens it adds to the conversation (--stats)."""
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from conftest import CHILD_CWD, child_env


# Run first in the child, a session leader of its own: opening the pseudo-terminal makes it
# the session's controlling terminal (so that its Ctrl-C reaches the chat as SIGINT), then
# the command replaces it.
_ATTACH = "import os, sys; os.close(os.open(sys.argv[1], os.O_RDWR)); os.execv(sys.executable, sys.argv[2:])"


class Terminal:
    """A process on the slave side of a pseudo-terminal; what it prints is read from the master."""

    def __init__(self, argv):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-c", _ATTACH, os.ttyname(slave)] + argv, stdin=slave,
                                     stdout=slave, stderr=slave, start_new_session=True,
                                     env=child_env(), cwd=CHILD_CWD)
        os.close(slave)
        self.out = ""

    def expect(self, pattern, timeout=300.0):
        """Reads until `pattern` appears after what earlier expects consumed; returns the text up to its end."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.out)
            if m:
                seen, self.out = self.out[:m.end()], self.out[m.end():]
                return seen
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} in {self.out!r}")
            if select.select([self.master], [], [], min(left, 1.0))[0]:
                try:
                    self.out += os.read(self.master, 4096).decode("utf-8", "replace").replace("\r\n", "\n")
                except OSError:  # EIO: the process has exited and closed the terminal
                    raise AssertionError(f"no {pattern!r} in {self.out!r}; the process ended") from None

    def send(self, text: str):
        os.write(self.master, text.encode())

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def fed(turn: str) -> int:
    return int(re.search(r"\[(\d+) prompt tokens fed, \d+ kept in the cache", turn).group(1))


def kept(turn: str) -> int:
    return int(re.search(r"prompt tokens fed, (\d+) kept in the cache", turn).group(1))


def test_two_turns_then_ctrl_c_ends_a_reply_not_the_chat_then_a_third_turn(smollm2):
    t = Terminal([sys.executable, "-m", "onnx_offload", "chat", smollm2, "--cpu", "--max-new-tokens", "400",
                  "--stats"])
    try:
        head = t.expect(r"\n> ")
        assert "decoding: greedy (the model's generation config sets no sampling); up to 400 new tokens a reply" in head
        t.send("What is the capital of France?\n")
        first = t.expect(r"\n> ")
        assert "Paris" in first and kept(first) == 0
        t.send("Say that again in one word.\n")
        second = t.expect(r"\n> ")
        assert second.strip().splitlines()[-3].strip()  # a reply, in the context of the first turn
        assert fed(second) < 20 and kept(second) > fed(first)  # the first turn stays in the cache
        t.send("Write a very long story about a dragon.\n")
        t.expect(r"dragon\.\n")  # the line, as the terminal echoes it
        story = t.expect(r"\w+ \w+ \w+ \w+")  # the reply is coming
        t.send("\x03")  # Ctrl-C, as the terminal sends it: SIGINT to the foreground process group
        stopped = t.expect(r"\[reply stopped\]\n.*\n> ")
        assert len(story + stopped) < 1500  # stopped well before its 400 tokens
        t.send("What is the capital of France?\n")
        third = t.expect(r"\n> ")
        assert "Paris" in third
        # the stopped reply's tokens stay in the cache and in the conversation
        assert fed(third) < 20 and kept(third) > kept(second) + fed(second) + 4
        t.send("\x04")  # Ctrl-D at the prompt ends the chat
        assert t.proc.wait(60) == 0
    finally:
        t.close()


@pytest.mark.parametrize("flags,line", [
    ([], "decoding: greedy (do_sample false in genai_config.json)"),
    (["--temperature", "0"], "decoding: greedy (--temperature 0)"),
    (["--do-sample"], "decoding: sampling (--do-sample), temperature 1.0 (genai_config.json), top_k 0 (the model's "
                      "top_k 1 left out: sampling was asked), top_p 1.0 (genai_config.json)"),
    (["--top-p", "0.9"], "decoding: sampling (--temperature, --top-k or --top-p given), temperature 1.0 "
                         "(genai_config.json), top_k 0 (the model's top_k 1 left out: sampling was asked), top_p "
                         "0.9 (--flag)"),
])
def test_the_settings_line_says_where_each_setting_came_from(tmp_path, flags, line):
    """A genai builder's folder: do_sample false and top_k 1 in genai_config.json."""
    import importlib.util
    from onnx_offload.models.decoder import decoder_lm, genai_config, save_decoder
    spec = importlib.util.spec_from_file_location(
        "make_model", os.path.join(os.path.dirname(__file__), "..", "models", "make_model.py"))
    make_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_model)
    folder = str(tmp_path / "llm")
    save_decoder(decoder_lm("gqa", vocab=97), folder, genai_config(2, 64, 4, 2, 97, 128))
    make_model.write_tokenizer(folder, 97)
    (tmp_path / "llm" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    out = subprocess.run([sys.executable, "-m", "onnx_offload", "chat", folder, "--cpu", "--max-new-tokens", "2",
                          *flags], input="w1\n", capture_output=True, text=True, timeout=300, env=child_env(),
                         cwd=CHILD_CWD)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(line), out.stdout
