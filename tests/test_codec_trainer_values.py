"""The codec on what a real trainer keeps in its state: Megatron-LM's ``args`` Namespace with
paths, dtypes, enums, activation functions and ``functools.partial`` init methods; the errors
for what it cannot store; decoding references safely (imported modules only, never calling)."""

from __future__ import annotations

import argparse
import colorsys
import enum
import functools
import graphlib
import importlib.util
import json
import math
import os
import pathlib
import struct
import subprocess
import sys
import textwrap

import msgpack
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_ckpt.errors import CodecError
from resilient_ckpt.model import codec_decode
from resilient_ckpt.model.codec import FORMAT_VERSION, decode, encode

# ExtType codes (resilient_ckpt.model.codec's table); literal so a renumbering fails here.
PURE_POSIX, PURE_WINDOWS, POSIX, WINDOWS, REF, PARTIAL, TUPLE, NAMESPACE = 6, 7, 8, 9, 34, 35, 16, 24


class AttnBackend(enum.Enum):  # megatron.core.transformer.enums.AttnBackend
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


class ModelType(enum.Enum):  # megatron.core.enums.ModelType
    encoder_or_decoder = 1


class Scaler:
    def __init__(self, k):
        self.k = k

    def apply(self, x):
        return x * self.k

    def __eq__(self, other):
        return type(other) is Scaler and other.k == self.k


def module_level_hook(step):
    return step


def megatron_args() -> argparse.Namespace:
    num_layers = 24
    return argparse.Namespace(
        num_layers=num_layers,
        hidden_size=1024,
        save=pathlib.Path("/lustre/ckpt/gpt-1b"),
        load=None,
        data_path=[pathlib.PurePosixPath("/data/a_text_document")],
        tokenizer_model=pathlib.PureWindowsPath(r"C:\tok\spm.model"),
        params_dtype=torch.bfloat16,
        main_grads_dtype=torch.float32,
        attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder,
        activation_func=F.gelu,  # a builtin of torch._C._nn
        bias_activation_fusion=False,
        init_method=functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02),
        output_layer_init_method=functools.partial(
            torch.nn.init.normal_, mean=0.0, std=0.02 / math.sqrt(2.0 * num_layers)
        ),
        rampup_batch_size=None,
        pipeline_model_parallel_layout=((0, 12), (12, (24,))),
        lr_decay_style="cosine",
        swiglu_func=F.silu,
        norm_cls=torch.nn.LayerNorm,
    )


def _frame(tree) -> bytes:
    """Hand-made encoding of a msgpack tree (no blobs)."""
    body = msgpack.packb(tree, use_bin_type=True)
    return struct.pack(">4sHHQ", b"RCKC", FORMAT_VERSION, 0, len(body)) + body


def _tag(code, *fields):
    return [msgpack.ExtType(code, b""), *fields]


# --- round trips ---------------------------------------------------------------------------


def test_megatron_style_args_round_trip_with_types_and_identities():
    args = megatron_args()
    out = decode(encode({"common": {"args": args, "iteration": 100}}))["common"]["args"]

    assert list(vars(out)) == list(vars(args))
    for k, v in vars(args).items():
        assert type(getattr(out, k)) is type(v), k
    assert out.save == args.save and str(out.tokenizer_model) == r"C:\tok\spm.model"
    assert out.params_dtype is torch.bfloat16 and out.main_grads_dtype is torch.float32
    assert out.attention_backend is AttnBackend.auto and out.model_type is ModelType.encoder_or_decoder
    assert out.activation_func is F.gelu and out.swiglu_func is F.silu
    assert out.norm_cls is torch.nn.LayerNorm
    assert out.pipeline_model_parallel_layout == ((0, 12), (12, (24,)))
    for name in ("init_method", "output_layer_init_method"):
        a, b = getattr(args, name), getattr(out, name)
        assert b.func is torch.nn.init.normal_ and b.args == a.args and b.keywords == a.keywords
    w = torch.empty(256, 256)
    out.init_method(w)  # the decoded partial is the working init method
    assert abs(w.std().item() - 0.02) < 0.002


def test_functions_are_stored_under_the_name_that_finds_them():
    # torch.sigmoid's __qualname__ is _VariableFunctionsClass.sigmoid, which no module
    # namespace holds; the encoder falls back to its __name__ and checks that it finds it.
    assert torch.sigmoid.__qualname__ != "sigmoid"
    refs = [torch.sigmoid, len, math.sqrt, int, torch.nn.Linear, module_level_hook, Scaler.apply]
    assert all(a is b for a, b in zip(refs, decode(encode(refs))))
    assert b"_VariableFunctionsClass" not in encode(torch.sigmoid)


def test_partial_keeps_positional_args_keywords_and_descriptive_attributes():
    p = functools.partial(torch.clamp, min=-1.0, max=(1.0))
    q = functools.partial(max, 3, -5, key=abs)
    q.__name__ = "max_abs"
    q.note = (pathlib.Path("x"), None)
    out_p, out_q = decode(encode([p, q]))
    assert out_p.func is torch.clamp and out_p.keywords == {"min": -1.0, "max": 1.0}
    assert out_q.func is max and out_q.args == (3, -5) and out_q.keywords == {"key": abs}
    assert vars(out_q) == {"__name__": "max_abs", "note": (pathlib.Path("x"), None)}
    assert out_q(2) == -5


def test_paths_decode_to_their_class():
    values = [
        pathlib.PurePosixPath("//net/a"),
        pathlib.PureWindowsPath("C:/A/b"),
        pathlib.Path("rel/\udcff-undecodable-byte"),
        pathlib.PurePosixPath(""),
    ]
    out = decode(encode(values))
    assert [type(v) for v in out] == [type(v) for v in values]
    assert [str(v) for v in out] == [str(v) for v in values]


@pytest.mark.skipif(os.name == "nt", reason="POSIX behaviour")
def test_a_windows_path_decodes_as_a_pure_windows_path_on_posix():
    # A WindowsPath cannot exist here, so its encoding is made by hand.
    out = decode(_frame([msgpack.ExtType(WINDOWS, b"C:\\data\\x"), msgpack.ExtType(POSIX, b"/a")]))
    assert type(out[0]) is pathlib.PureWindowsPath and str(out[0]) == "C:\\data\\x"
    assert type(out[1]) is pathlib.PosixPath


def test_a_reader_that_predates_the_new_codes_rejects_them(monkeypatch):
    # Why FORMAT_VERSION stays: an older reader refuses a new code, it never mis-decodes it.
    for code in (REF, PARTIAL):
        monkeypatch.delitem(codec_decode._TAG_DECODERS, code)
    for code in (PURE_POSIX, PURE_WINDOWS, POSIX, WINDOWS):
        monkeypatch.delitem(codec_decode._SCALAR_DECODERS, code)
    for value, code in [(len, REF), (functools.partial(max, 1), PARTIAL), (pathlib.Path("a"), POSIX)]:
        with pytest.raises(CodecError, match=rf"unexpected ExtType code {code} at .*unknown code"):
            decode(encode({"v": value}))


# --- what cannot be stored: the error names the key path, the type and the fix -------------


def _encode_error(value) -> str:
    with pytest.raises(CodecError) as ei:
        encode({"common": {"args": argparse.Namespace(hook=value)}})
    return str(ei.value)


def test_a_lambda_is_refused_naming_path_and_why_pickle_would_not_help():
    msg = _encode_error(lambda step: step)
    assert msg.startswith("cannot encode the function test_codec_trainer_values.test_a_lambda")
    assert "<locals>.<lambda> at common/args/hook: it cannot be found by that name" in msg
    assert "define it at module level" in msg and "functools.partial" in msg
    assert "allow_pickle=True does not help here" in msg


def test_a_local_function_inside_a_partial_is_reported_at_the_partial_field():
    def local_init(t, std):
        return t

    msg = _encode_error(functools.partial(local_init, std=0.02))
    assert "local_init at common/args/hook/<partial func>:" in msg


def test_an_unencodable_partial_keyword_is_reported_with_its_key():
    msg = _encode_error(functools.partial(max, key=object()))
    assert "object of type object at common/args/hook/<partial keywords>/key" in msg


def test_an_object_of_a_local_class_names_path_type_allow_pickle_and_the_class_fix():
    class Local:
        pass

    msg = _encode_error(Local())
    assert "cannot encode object of type test_codec_trainer_values.test_an_object_of_a_local_class" in msg
    assert "<locals>.Local at common/args/hook without pickle" in msg
    assert "pass allow_pickle=True to CheckpointManager/LocalCheckpointManager to store it pickled" in msg
    assert "(local data only: unpickling runs code" in msg
    assert msg.endswith("define the class at module level first")


def test_a_bound_method_is_refused_and_allow_pickle_stores_it():
    scaler = Scaler(3)
    msg = _encode_error(scaler.apply)
    assert "cannot encode the bound method test_codec_trainer_values.Scaler.apply at common/args/hook" in msg
    assert "pass allow_pickle=True to CheckpointManager/LocalCheckpointManager" in msg
    data = encode({"hook": scaler.apply}, allow_pickle=True)
    with pytest.raises(CodecError, match=r"refusing to unpickle .* at hook"):
        decode(data)
    assert decode(data, allow_pickle=True)["hook"](2) == 6


@pytest.mark.parametrize(
    "value, name",
    [(os.system, "posix.system"), (eval, "builtins.eval"), (subprocess.run, "subprocess.run")],
)
def test_shell_and_eval_entry_points_are_never_stored_by_name(value, name):
    msg = _encode_error(value)
    assert msg.startswith(f"refusing to encode the reference at common/args/hook: {name} is never stored")
    assert "allow_pickle=True" in msg


def test_dunder_attributes_that_python_would_call_are_refused():
    ns = argparse.Namespace()
    vars(ns)["__deepcopy__"] = module_level_hook
    with pytest.raises(CodecError, match=r"argparse.Namespace at args: it has the attribute '__deepcopy__'"):
        encode({"args": ns})
    p = functools.partial(max)
    p.__reduce_ex__ = module_level_hook
    with pytest.raises(CodecError, match=r"'__reduce_ex__'"):
        encode(p)


# --- decoding references: imported modules only, nothing runs -----------------------------


def _write_module(tmp_path, monkeypatch, name, source):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    return sys.modules[name]


def test_reference_to_a_module_not_imported_is_refused_without_importing_it(tmp_path, monkeypatch):
    mod = _write_module(
        tmp_path,
        monkeypatch,
        "codec_trainer_mod",
        """
        def init(t, std=1.0):
            return t
        """,
    )
    hook = encode({"args": argparse.Namespace(hook=mod.init)})
    partial = encode({"args": argparse.Namespace(init_method=functools.partial(mod.init, std=0.02))})
    monkeypatch.delitem(sys.modules, "codec_trainer_mod")
    with pytest.raises(CodecError) as ei:
        decode(hook)
    assert str(ei.value) == (
        "cannot decode the reference to codec_trainer_mod.init at args/hook: module "
        "'codec_trainer_mod' is not imported, and decoding never imports (importing runs code). "
        "Fix: import codec_trainer_mod before loading"
    )
    with pytest.raises(
        CodecError, match=r"at args/init_method/<partial func>: .*import codec_trainer_mod before"
    ):
        decode(partial)
    assert "codec_trainer_mod" not in sys.modules
    monkeypatch.setitem(sys.modules, "codec_trainer_mod", mod)
    assert decode(hook)["args"].hook is mod.init
    assert decode(partial)["args"].init_method.func is mod.init


FRESH_INTERPRETER = """
import json, sys
from resilient_ckpt.errors import CodecError
from resilient_ckpt.model.codec import decode
result = {}
try:
    decode(open(sys.argv[1], "rb").read())
except CodecError as e:
    result["error"] = str(e)
result["imported"] = [m for m in ("colorsys", "graphlib") if m in sys.modules]
print(json.dumps(result))
"""


@pytest.mark.slow
def test_a_fresh_process_refuses_references_to_modules_it_has_not_imported(tmp_path):
    data = tmp_path / "common.rckc"
    data.write_bytes(
        encode({"args": argparse.Namespace(color=colorsys.rgb_to_hsv, sort=graphlib.TopologicalSorter)})
    )
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_INTERPRETER, str(data)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["imported"] == []
    assert result["error"].startswith("cannot decode the reference to colorsys.rgb_to_hsv at args/color:")
    assert result["error"].endswith("Fix: import colorsys before loading")


def test_lookup_runs_no_module_getattr_and_leaves_lazy_modules_unloaded(tmp_path, monkeypatch):
    mod = _write_module(
        tmp_path,
        monkeypatch,
        "codec_getattr_mod",
        """
        CALLS = []
        def __getattr__(name):
            CALLS.append(name)
            return len
        """,
    )
    with pytest.raises(CodecError, match=r"codec_getattr_mod.anything names nothing"):
        decode(_frame(_tag(REF, "codec_getattr_mod", "anything")))
    assert mod.CALLS == []

    (tmp_path / "codec_lazy_mod.py").write_text(
        "import sys\nsys.modules['codec_lazy_ran'] = sys\ndef f(): pass\n"
    )
    spec = importlib.util.spec_from_file_location("codec_lazy_mod", tmp_path / "codec_lazy_mod.py")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    lazy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "codec_lazy_mod", lazy)
    spec.loader.exec_module(lazy)
    with pytest.raises(CodecError, match=r"codec_lazy_mod.f names nothing"):
        decode(_frame(_tag(REF, "codec_lazy_mod", "f")))
    assert "codec_lazy_ran" not in sys.modules  # the module's code never ran


# --- malformed payloads: CodecError only ---------------------------------------------------


def _ref(module, name):
    return _tag(REF, module, name)


MALFORMED = [
    (_tag(REF), "malformed reference at <root>: 0 fields, expected 2"),
    (_tag(REF, "math"), "1 fields, expected 2"),
    (_tag(REF, "math", "sqrt", "x"), "3 fields, expected 2"),
    (_tag(REF, 1, "sqrt"), "reference module at <root> must be a str"),
    (_tag(REF, "math", b"sqrt"), "reference name at <root> must be a str"),
    (_ref("math", "pi"), "math.pi names a float in the imported module, not a function or class"),
    (_ref("torch", "nn"), "torch.nn names a module"),
    (_ref("math", "nope"), "math.nope names nothing"),
    (_ref("math", ""), "math. names nothing"),
    (_ref("torch.nn.Linear", "forward"), "module 'torch.nn.Linear' is not imported"),
    (_ref("torch.nn", "Linear.forward.__code__"), "names nothing"),
    (_ref("builtins", "eval"), "refusing to decode the reference at <root>: builtins.eval is never"),
    (_ref("os", "system"), "refusing to decode"),
    (_ref("subprocess", "Popen"), "refusing to decode"),
    (_tag(PARTIAL), "malformed functools.partial at <root>: 0 fields, expected 4"),
    (_tag(PARTIAL, _ref("builtins", "max"), _tag(TUPLE), {}), "3 fields, expected 4"),
    (_tag(PARTIAL, 5, _tag(TUPLE), {}, {}), "malformed functools.partial at <root>"),
    (_tag(PARTIAL, _ref("builtins", "max"), [1], {}, {}), "malformed functools.partial"),
    (_tag(PARTIAL, _ref("builtins", "max"), _tag(TUPLE), [], {}), "malformed functools.partial"),
    (_tag(PARTIAL, _ref("builtins", "max"), _tag(TUPLE), {1: 2}, {}), "a non-str keyword"),
    (_tag(PARTIAL, _ref("builtins", "max"), _tag(TUPLE), {}, {"__deepcopy__": 1}), "'__deepcopy__'"),
    (_tag(PARTIAL, _ref("builtins", "max"), _tag(TUPLE), {}, {2: 1}), "non-str attribute name"),
    (_tag(PARTIAL, _ref("math", "tau"), _tag(TUPLE), {}, {}), "at <partial func>: math.tau names a float"),
    (_tag(NAMESPACE, {"__class__": 1}), "malformed argparse.Namespace at <root>: the attribute '__class__'"),
    (msgpack.ExtType(PURE_POSIX, b"\xff"), "malformed PurePosixPath at <root>"),
    (msgpack.ExtType(WINDOWS, b"\xc3"), "malformed"),
]


@pytest.mark.parametrize("tree, message", MALFORMED, ids=[repr(t)[:60] for t, _ in MALFORMED])
def test_malformed_references_partials_and_paths_raise_codec_error_naming_the_problem(tree, message):
    with pytest.raises(CodecError) as ei:
        decode(_frame(tree))
    assert message in str(ei.value)


names = st.sampled_from(
    ["math", "sqrt", "pi", "builtins", "len", "eval", "torch", "nn", "nn.Linear", "Linear", "torch.nn"]
    + ["os", "system", "__dict__", "", ".", "a.b", "colorsys", "rgb_to_hsv", "__getattr__", "__class__"]
)
fields = st.one_of(names, st.text(max_size=6), st.integers(-2, 40), st.binary(max_size=4), st.none())


@settings(max_examples=400, deadline=None)
@given(st.lists(fields, max_size=4), st.lists(fields, max_size=5), st.dictionaries(names, fields, max_size=3))
def test_arbitrary_reference_and_partial_fields_raise_only_codec_error_and_import_nothing(ref, args, kw):
    before = set(sys.modules)
    for tree in (
        _tag(REF, *ref),
        _tag(PARTIAL, _tag(REF, *ref), _tag(TUPLE, *args), kw, {}),
        _tag(PARTIAL, *args),
    ):
        try:
            out = decode(_frame(tree))
        except CodecError:
            continue
        assert callable(out)  # a function, class or partial of one: nothing else gets through
    assert set(sys.modules) <= before


def test_a_simple_namespace_round_trips_as_itself():
    """Megatron's tests (and some trainers) keep args in a types.SimpleNamespace."""
    import types

    args = types.SimpleNamespace(lr=3e-4, nested=argparse.Namespace(seq=2048), dtype=torch.bfloat16)
    out = decode(encode({"args": args}))["args"]
    assert type(out) is types.SimpleNamespace and type(out.nested) is argparse.Namespace
    assert vars(out) == {"lr": 3e-4, "nested": argparse.Namespace(seq=2048), "dtype": torch.bfloat16}
