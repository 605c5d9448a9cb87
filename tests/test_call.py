"""The declared argument list (``flashdecode.call.ARGUMENTS``): every entry point, the traced ops'
schema and the compiled host path's layout come from it, and a keyword-only argument added there
(one line) reaches each of them and ``validate.check_call``."""
import inspect
import os
import pathlib
import shutil
import subprocess
import sys

from flashdecode import DecodeContext, call, flash_attn_with_kvcache, flash_decode_with_kvcache, host_path, ops, plan_for

REPO = pathlib.Path(__file__).resolve().parents[1]


def parameter_names(function) -> list:
    return [name for name in inspect.signature(function).parameters if name not in ("self", "context")]


def test_every_entry_point_takes_the_declared_arguments():
    for function in (flash_attn_with_kvcache, flash_decode_with_kvcache, plan_for, DecodeContext.run):
        assert sorted(parameter_names(function)) == sorted(call.NAMES), function.__name__
        defaults = {name: parameter.default for name, parameter in inspect.signature(function).parameters.items()}
        assert all(defaults[argument.name] == argument.default for argument in call.ARGUMENTS
                   if argument.default is not call.REQUIRED), function.__name__
    assert parameter_names(flash_attn_with_kvcache) == list(call.NAMES)
    assert call.Call._fields == call.NAMES


def test_the_traced_ops_and_the_host_path_take_the_declared_arguments():
    traced = [argument.name for argument in call.ARGUMENTS if argument.traced_as is not None]
    assert [argument.name for argument in ops.attend._opoverload._schema.arguments] == traced
    keys, out, return_lse = host_path.LAYOUT
    assert len(keys) == len(call.ARGUMENTS) and call.NAMES[out] == "out"
    assert call.NAMES[return_lse] == "return_softmax_lse"
    assert host_path.CALL_TENSORS == tuple(argument.name for argument in call.ARGUMENTS
                                           if argument.kind == call.TENSOR and argument.host_path)


ADDED = '    Argument("added_argument", None, TENSOR, "Tensor?", keyword_only=True, host_path=False),\n'

CHECK = """
import inspect, torch, flashdecode
from flashdecode import context, host_path, ops
assert flashdecode.__file__.startswith({root!r}), flashdecode.__file__
for function in (flashdecode.flash_attn_with_kvcache, flashdecode.flash_decode_with_kvcache, flashdecode.plan_for):
    parameter = inspect.signature(function).parameters["added_argument"]
    assert parameter.kind is parameter.KEYWORD_ONLY and parameter.default is None, function
assert list(inspect.signature(flashdecode.DecodeContext.run).parameters)[-1] == "added_argument"
assert flashdecode.call.NAMES[-1] == "added_argument"
assert "Tensor? added_argument" in ops._schema(())
assert host_path.LAYOUT[0][-1] == host_path.KEY_NONE_ONLY and "added_argument" not in host_path.CALL_TENSORS
checked, seen = context.check_call, []
context.check_call = lambda added_argument, **metas: (seen.append(added_argument), checked(**metas))[1]
q, k = torch.randn(1, 1, 4, 8).half(), torch.randn(1, 16, 2, 8).half()
out = flashdecode.flash_attn_with_kvcache(q, k, k, cache_seqlens=5, added_argument=None, backend="reference")
assert out.shape == q.shape and seen == [None], seen
print("reached")
"""


def test_a_keyword_only_argument_is_one_line(tmp_path):
    """A copy of the package with one line added at the end of ARGUMENTS: the entry points take the
    argument (keyword-only, last), check_call receives it, the ops' schema has it, and the host path
    takes it only as None."""
    shutil.copytree(REPO / "flashdecode", tmp_path / "flashdecode", ignore=shutil.ignore_patterns("__pycache__"))
    source = tmp_path / "flashdecode" / "call.py"
    text = source.read_text()
    end = text.index("\n)\n", text.index("ARGUMENTS = (")) + 1
    source.write_text(text[:end] + ADDED + text[end:])
    done = subprocess.run([sys.executable, "-c", CHECK.format(root=str(tmp_path))], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "reached" in done.stdout, done.stderr[-3000:]
