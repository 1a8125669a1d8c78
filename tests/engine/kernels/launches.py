"""The Triton launches the engine's kernels make, recorded from their own launchers on a simulated GPU.

`record(target)` runs the calls of `launch_calls*.py` (each kernel op's entry point at Qwen3.5-35B-A3B's
shapes) with three things swapped in, and nothing else: tensors live on the meta device but say they are on
`cuda:0` (no memory, no data), `torch.cuda` answers as the target's GPU (capability, multiprocessors, name),
and `JITFunction.run` records instead of launching. So each launcher takes the choices it would take on that
GPU: tiles from the shapes and the SM count, the tuned MoE table named by the GPU (`moe/configs/<name>.json`),
PDL where `engine.kernels.pdl` turns it on (capability 9.0 and later). A recorded `Launch` is what Triton's
own launcher hands its compiler: the signature and specialisation (pointer dtypes, 16-byte alignment of
each pointer from its storage offset, ints of value 1 as constexprs, multiples of 16 marked divisible), the
constexprs and the launch options (num_warps, num_stages, launch_pdl, ...). `compile_launch` compiles one for
the target without a GPU.

Run `record` in a fresh process without TRITON_INTERPRET (kernel modules imported under it hold no
compilable kernels, and the launchers cache what the simulated GPU told them).

Another GPU is another `Target` in TARGETS (then a parameter of `test_compile_sm90.py`): sm_100 would be
`Target(100, "NVIDIA B200", 148, 232448)`, sm_120 `Target(120, "NVIDIA RTX PRO 6000 Blackwell Server
Edition", 188, 101376)` (torch.cuda's name, the SM count, the per-block shared memory opt-in). The launchers
then take that GPU's choices: its tuned MoE table if `moe/configs/<name>.json` exists (else the shape
rules), splits from its SM count, PDL from capability 9.0 on. On a machine with that GPU, `python -m
tests.engine.kernels.launches --check [sm_XX]` compares the simulated launches with the real GPU's.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Target:
    """A GPU to record launches for and compile them to."""

    arch: int  # compute capability as Triton's GPUTarget takes it: 90 for sm_90
    device_name: str  # what torch.cuda.get_device_name says: it names the tuned MoE table
    multiprocessors: int
    max_shared: int  # bytes of shared memory one block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    warp_size: int = 32

    @property
    def name(self) -> str:
        return f"sm_{self.arch}"

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, self.warp_size)


SM90 = Target(90, "NVIDIA H200", 132, 232448)
TARGETS = {target.name: target for target in (SM90,)}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as its compiler sees it. `constexprs` and `attrs` are keyed by argument path (a
    list, as Triton's tuple paths); `options` are the launch's keyword options."""

    module: str
    kernel: str
    signature: dict[str, str]
    constexprs: list[tuple[list[int], Any]]
    attrs: list[tuple[list[int], list]]
    options: dict[str, Any]
    constexpr_names: tuple[str, ...]  # the kernel's tl.constexpr parameters, for the name
    suffix: str = ""  # "#2", ... where launches that differ only in argument dtypes share a name

    @property
    def name(self) -> str:
        """`op kernel dtypes CONSTEXPR=value ... warps=4 stages=3`, e.g. `norm rms_norm bf16 BR=2 ...`; the
        arguments passed as None (or left at a None default) are left out."""
        op = self.module.removeprefix("engine.kernels.").removesuffix(".triton")
        kernel = self.kernel.strip("_").removesuffix("_kernel")
        dtypes = list(dict.fromkeys(t[1:] for t in self.signature.values() if t.startswith("*")))
        names = list(self.signature)
        values = {names[p[0]]: v for p, v in self.constexprs if len(p) == 1 and v is not None}
        fixed = [f"{k}={v}" for k, v in values.items() if k in self.constexpr_names and k != "PDL"]
        ones = [f"{k}=1" for k, v in values.items() if k not in self.constexpr_names]
        options = [f"{k.removeprefix('num_')}={v}" for k, v in self.options.items() if k != "launch_pdl"]
        pdl = ["PDL"] if values.get("PDL") else []
        return " ".join([op, kernel, "/".join(dtypes), *fixed, *ones, *options, *pdl, self.suffix]).strip()

    @property
    def variant(self) -> str:
        """What makes it another compile, less the divisibility of its ints and pointers (a token count of 8
        or 64): the kernel, its argument types, constexprs (ints of value 1 included) and options."""
        return json.dumps([self.module, self.kernel, self.signature, self.constexprs, self.options])

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # the signature keeps the kernel's argument order

    @classmethod
    def from_json(cls, text: str) -> Launch:
        data = json.loads(text)
        data["constexprs"] = [(p, v) for p, v in data["constexprs"]]
        data["attrs"] = [(p, a) for p, a in data["attrs"]]
        data["constexpr_names"] = tuple(data["constexpr_names"])
        return cls(**data)


def record(
    target: Target = SM90, calls: list[Callable[[], None]] | None = None, simulate: bool = True
) -> list[Launch]:
    """The distinct launches of `calls` (default: those of `launch_calls*.py`) on `target`, in first-seen
    order. `simulate=False` runs them on the real GPU instead (empty tensors, still nothing launched): on a
    machine with `target`'s GPU, that checks the simulation (`python -m tests.engine.kernels.launches
    --check`)."""
    if calls is None:
        from tests.engine.kernels import launch_calls, launch_calls_matmul

        calls = launch_calls.CALLS + launch_calls_matmul.CALLS
    launches: dict[str, Launch] = {}
    fallbacks: list[str] = []
    gpu = simulated_gpu(target) if simulate else contextlib.nullcontext()
    with _engine_defaults(), gpu, _recording(target, launches), _fallbacks(fallbacks):
        for call in calls:
            where = f"{call.__module__}.{call.__name__}"
            try:
                call()
            except Exception as e:  # an entry point changed under the call: say which call to update
                raise RuntimeError(f"{where} failed on the {'simulated ' if simulate else ''}GPU: {e}") from e
            if fallbacks:
                raise RuntimeError(f"{where} does not reach the kernels of {'; '.join(fallbacks)}: change it")
    found, seen = [], {}
    for launch in launches.values():
        seen[launch.name] = seen.get(launch.name, 0) + 1
        found.append(replace(launch, suffix=f"#{seen[launch.name]}") if seen[launch.name] > 1 else launch)
    return found


def unlaunched(launches: list[Launch]) -> list[str]:
    """Every `@triton.jit` `*_kernel` defined in engine.kernels that none of `launches` launches."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import engine.kernels

    seen = {(launch.module, launch.kernel) for launch in launches}
    missing = []
    for info in pkgutil.walk_packages(engine.kernels.__path__, "engine.kernels."):
        for name, value in vars(importlib.import_module(info.name)).items():
            kernel = isinstance(value, JITFunction) and value.module == info.name and name.endswith("_kernel")
            if kernel and (info.name, name) not in seen:
                missing.append(f"{info.name}.{name}")
    return missing


def compile_launch(launch: Launch, target: Target = SM90):
    """Compile `launch` for `target` (no GPU needed; ptxas ships with Triton): the CompiledKernel."""
    import importlib

    import triton
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.kernel)
    source = ASTSource(
        fn=fn,
        signature=dict(launch.signature),
        constexprs={tuple(path): value for path, value in launch.constexprs},
        attrs={tuple(path): attr for path, attr in launch.attrs},
    )
    return triton.compile(source, target=target.gpu_target(), options=dict(launch.options))


def resource_usage(kernel) -> dict[str, int]:
    """Registers per thread and stack bytes per thread (spilled registers) of a CompiledKernel's cubin, as
    the cuobjdump shipped with Triton's NVIDIA backend reports them; {} where that tool is missing."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() or "cubin" not in kernel.asm:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(found[1]), "stack": int(found[2])} if found else {}


# ---------------------------------------------------------------------------------------------------------
# The simulated GPU.

_CUDA, _META = torch.device("cuda", 0), torch.device("meta")
_DEVICE, _IS_CUDA = torch.Tensor.device, torch.Tensor.is_cuda


def _to_meta(value):
    if isinstance(value, torch.device) and value.type == "cuda":
        return _META
    if isinstance(value, str) and value.startswith("cuda"):
        return _META
    return value


class _MetaAsCuda(TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on the meta device, and meta tensors say `cuda:0`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE:
            device = func(*args)
            return _CUDA if device.type == "meta" else device
        if owner is _IS_CUDA:
            return args[0].is_meta or func(*args)
        if func is torch.device:
            return func(*args, **kwargs)
        if (
            func is torch.empty_like
            and args[0].is_meta
            and args[0].is_contiguous()
            and set(kwargs) <= {"dtype"}
        ):
            # The same tensor: meta's own empty_like goes through torch._refs, which imports sympy (2-3 s).
            return torch.empty(args[0].shape, dtype=kwargs.get("dtype", args[0].dtype), device=_META)
        args = tuple(_to_meta(a) for a in args)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _to_meta(kwargs["device"])}
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated_gpu(target: Target) -> Iterator[None]:
    """torch.cuda answers as one `target` GPU, and CUDA tensors are meta tensors (see `_MetaAsCuda`)."""
    major, minor = divmod(target.arch, 10)
    props = SimpleNamespace(
        name=target.device_name,
        major=major,
        minor=minor,
        multi_processor_count=target.multiprocessors,
        shared_memory_per_block_optin=target.max_shared,
        total_memory=141 << 30,
        warp_size=target.warp_size,
    )
    answers = dict(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        get_device_capability=lambda device=None: (major, minor),
        get_device_properties=lambda device=None: props,
        get_device_name=lambda device=None: target.device_name,
        is_current_stream_capturing=lambda: False,
    )
    with contextlib.ExitStack() as stack:
        for name, answer in answers.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, answer))
        stack.enter_context(_MetaAsCuda())
        yield


@contextlib.contextmanager
def _engine_defaults() -> Iterator[None]:
    """Every engine variable at its default, except ENCLAVE_KERNELS=triton (the Triton op even where `auto`
    prefers the reference, e.g. sampling below 64 rows); TRITON_INTERPRET unset."""
    from engine.env import VARIABLES, reset_engine_env

    names = {variable.name for variable in VARIABLES}
    environ = {k: v for k, v in os.environ.items() if k not in names}
    environ.pop("TRITON_INTERPRET", None)
    environ["ENCLAVE_KERNELS"] = "triton"
    with mock.patch.dict(os.environ, environ, clear=True):
        reset_engine_env()
        try:
            yield
        finally:
            reset_engine_env()


@contextlib.contextmanager
def _recording(target: Target, launches: dict[str, Launch]) -> Iterator[None]:
    """`JITFunction.run` binds and specialises the arguments as Triton's launcher does (its own binder, for
    `target`'s backend) and adds the launch to `launches` (the first of each `variant`), instead of running
    it."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(target.gpu_target())
    binders: dict[int, Callable] = {}

    def run(fn, *args, grid, warmup, **kwargs):
        binder = binders.get(id(fn))
        if binder is None:
            binder = binders[id(fn)] = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        launch = Launch(
            module=fn.module,
            kernel=fn.fn.__name__,
            signature=signature,
            constexprs=[(list(path), _plain(value)) for path, value in constexprs.items()],
            attrs=[(list(path), attr) for path, attr in attrs.items() if attr],
            options=options,
            constexpr_names=tuple(p.name for p in fn.params if p.is_constexpr),
        )
        launches.setdefault(launch.variant, launch)

    with mock.patch.object(JITFunction, "run", run):
        yield


@contextlib.contextmanager
def _fallbacks(found: list[str]) -> Iterator[None]:
    """Each `dispatch.fallback` (an entry point sending its inputs to the reference) adds `op (reason)` to
    `found`: a call that falls back records none of its op's launches."""
    from engine.kernels import dispatch

    original = dispatch.fallback

    def fallback(op, reason, *args, **kwargs):
        found.append(f"{op} (it falls back: {reason})")
        return original(op, reason, *args, **kwargs)

    with mock.patch.object(dispatch, "fallback", fallback):
        yield


def _plain(value):
    """A constexpr's value as JSON holds it (bool, int, float, str, None)."""
    value = getattr(value, "value", value)  # tl.constexpr
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot record the constexpr value {value!r} ({type(value).__name__})")


def _check(target: Target) -> None:
    """On a machine with `target`'s GPU: the launches recorded on the simulated GPU and on the real one,
    compared (in two processes: the launchers cache what the GPU told them)."""
    import subprocess
    import sys

    runs = []
    for flag in ("--simulated", "--real"):
        argv = [sys.executable, "-m", "tests.engine.kernels.launches", flag, target.name]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        runs.append({Launch.from_json(line).variant: line for line in out.splitlines()})
    simulated, real = runs
    for name, only in (
        ("simulated", simulated.keys() - real.keys()),
        ("real", real.keys() - simulated.keys()),
    ):
        for key in sorted(only):
            print(f"only {name}: {Launch.from_json((simulated | real)[key]).name}")
    attrs = [k for k in simulated.keys() & real.keys() if json.loads(simulated[k]) != json.loads(real[k])]
    for key in attrs:
        print(f"other specialisation: {Launch.from_json(real[key]).name}")
    print(f"{len(simulated)} simulated, {len(real)} real, {len(simulated.keys() & real.keys())} in both")


def _main(argv: list[str]) -> None:
    """`[--simulated | --real | --check] [sm_XX]`: print the launches (JSON lines) recorded on the simulated
    or the real GPU, or compare the two."""
    target = TARGETS[next((a for a in argv if not a.startswith("--")), SM90.name)]
    if "--check" in argv:
        _check(target)
    else:
        for found in record(target, simulate="--real" not in argv):
            print(found.to_json())


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
