"""The supervisor's own command line: `[--termination-log PATH] -- CMD ...`."""

import pytest
from shoal.supervisor.__main__ import UsageError, parse_args


@pytest.mark.parametrize("args, environ, expected", [
    (["--", "vllm", "serve", "m"], {}, ("/dev/termination-log", ["vllm", "serve", "m"])),
    (["--", "vllm", "--", "x"], {}, ("/dev/termination-log", ["vllm", "--", "x"])),
    (["--", "vllm"], {"SHOAL_TERMINATION_LOG": "/t/log"}, ("/t/log", ["vllm"])),
    (["--termination-log", "/a", "--", "vllm"], {"SHOAL_TERMINATION_LOG": "/t"}, ("/a", ["vllm"])),
    (["--termination-log=/b", "--", "vllm"], {}, ("/b", ["vllm"])),
])
def test_the_path_and_the_command(args, environ, expected):
    assert parse_args(args, environ) == expected


@pytest.mark.parametrize("args, says", [
    (["vllm", "serve"], "no '--'"),
    (["--"], "no command"),
    (["--verbose", "--", "vllm"], "unknown option '--verbose'"),
    (["--termination-log", "--", "vllm"], "--termination-log needs a path"),
])
def test_a_bad_command_line_is_refused_naming_what(args, says):
    with pytest.raises(UsageError, match=says):
        parse_args(args, {})
