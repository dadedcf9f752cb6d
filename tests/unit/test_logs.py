"""Logs for people and for machines: readable text lines on a terminal, JSON lines otherwise (or
as ``--log-format`` says), with the same fields."""

import json
import logging
import os
import pty
import subprocess
import sys

from ember.jsonlog import JsonFormatter, TextFormatter


def _record():
    r = logging.LogRecord("ember.engine", logging.INFO, __file__, 1, "packed pass", None, None)
    r.requests, r.tokens = 2, 512
    return r


def test_text_and_json_lines_carry_the_same_fields():
    text = TextFormatter().format(_record())
    assert " INFO  ember.engine" in text and "packed pass" in text and "requests=2 tokens=512" in text
    line = json.loads(JsonFormatter().format(_record()))
    assert line["msg"] == "packed pass" and line["requests"] == 2 and line["tokens"] == 512


def test_auto_is_text_on_a_terminal_and_json_in_a_file(tmp_path):
    code = "import sys; from ember.jsonlog import resolve_format; print(resolve_format('auto'))"
    master, slave = pty.openpty()
    try:
        on_tty = subprocess.run([sys.executable, "-c", code], stderr=slave, capture_output=False, stdout=subprocess.PIPE,
                                text=True, timeout=60, check=True).stdout.strip()
    finally:
        os.close(master)
        os.close(slave)
    with open(tmp_path / "log", "w") as fh:
        in_file = subprocess.run([sys.executable, "-c", code], stderr=fh, stdout=subprocess.PIPE, text=True,
                                 timeout=60, check=True).stdout.strip()
    assert (on_tty, in_file) == ("text", "json")
