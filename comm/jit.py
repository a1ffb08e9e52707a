"""`@tilecomm.jit`: one kernel source for GPUs (Triton compiler) and CPU ranks (Triton interpreter).

`TileKernel` is a `triton.JITFunction`, so the Triton compiler treats it (and the
`tilecomm.language` primitives, which are TileKernels too) like any jit function. Launching
`kernel[grid](...)` picks the path from the runtime's backend:

* cuda: the ordinary compiled launch; kernels that use NVSHMEM device calls get
  `libnvshmem_device.bc` linked in and their module registered with NVSHMEM after compiling.
* cpu: the Triton interpreter runs the same source, program after program, without the user
  setting TRITON_INTERPRET. A primitive called from inside runs its CPU implementation (plain
  `tl` operations on the shared-memory heap), and a `WaitTimeoutError` raised there reaches the
  caller as itself, not wrapped in Triton's InterpreterError.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as _interp
from triton.runtime.interpreter import InterpretedFunction, InterpreterError
from triton.runtime.jit import JITFunction

from . import runtime
from .errors import TilecommError


def _install_numpy2_index_fix() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with `int(array_of_shape_(1,))`, which
    NumPy >= 2.4 refuses; `range(n)` over a scalar kernel argument then fails. Re-patch
    `tensor.__index__` after Triton's own patching to take the single element explicitly."""
    original = _interp._patch_lang_tensor
    if getattr(original, "_tilecomm_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tilecomm_fixed = True
    _interp._patch_lang_tensor = patched


def _install_bf16_dot_fix() -> None:
    """Triton 3.6's interpreter multiplies bfloat16 operands of tl.dot as their raw uint16 bits.
    Widen them to float32 first (exact), as the GPU's bf16 MMA effectively does."""
    builder = _interp.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_tilecomm_fixed", False):
        return

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return _interp.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._tilecomm_fixed = True
    builder.create_dot = create_dot


def _install_builtin_list_cache() -> None:
    """Triton's interpreter finds the builtins of tl, tl.tensor, tl.math... with `inspect.getmembers` on every
    launch (`_patch_builtin`, ~0.3 ms per module, a fifth of a small collective's time on CPU ranks). The list
    is the same each time: find it once, from the unpatched modules (the first launch), and patch from it."""
    original = _interp._patch_builtin
    if getattr(original, "_tilecomm_fixed", False):
        return
    found: dict = {}

    def patch_builtin(pkg, builder, scope):
        members = found.get(pkg)
        if members is None:
            members = found[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, member in members:
            _interp._patch_attr(pkg, name, member, builder, scope)

    patch_builtin._tilecomm_fixed = True
    _interp._patch_builtin = patch_builtin


def _install_direct_overflow_check() -> None:
    """The interpreter checks every int32 add / sub / mul for overflow (its `sanitize_overflow` option, on by
    default) through a dozen interpreted tl operations per check (two casts, the operation, two compares,
    an and, an assert): a quarter of a small collective's time on CPU ranks. The operands are numpy arrays
    there: check them directly in int64, with the same rule and message."""
    sem = _interp.interpreter_semantic
    original = sem.binary_op_sanitize_overflow_impl
    if getattr(original, "_tilecomm_fixed", False):
        return
    ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply}

    def check(lhs, rhs, binary_op):
        ty, op = lhs.type.scalar, ops.get(getattr(binary_op, "__name__", ""))
        if ty.int_bitwidth >= 64 or not sem.builder.options.sanitize_overflow:
            return None
        if op is None or ty != rhs.type.scalar or not ty.is_int():
            return original(lhs, rhs, binary_op)
        ret = op(np.asarray(lhs.handle.data, dtype=np.int64), np.asarray(rhs.handle.data, dtype=np.int64))
        if ret.size and (ret.max() > ty.get_int_max_value() or ret.min() < ty.get_int_min_value()):
            raise AssertionError(f"int{ty.int_bitwidth} overflow detected for operation {binary_op.__name__}")
        return None

    check._tilecomm_fixed = True
    sem.binary_op_sanitize_overflow_impl = check


def _install_np_dtype_cache() -> None:
    """The interpreter maps a tl dtype to its numpy dtype through a dict of ~20 np.dtype objects built on every
    call (`_get_np_dtype`, ~50 µs, called on every cast, load and fill: 5% of a CPU dispatch soak's time).
    The mapping never changes: remember each element type's answer (a block maps as its element type;
    pointer types, all uint64, keep the original's test)."""
    original = _interp._get_np_dtype
    if getattr(original, "_tilecomm_fixed", False):
        return
    known: dict = {}

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype  # (blocks: unhashable)
        if isinstance(element, tl.pointer_type):
            return original(tt_dtype)
        got = known.get(element)
        if got is None:
            got = known[element] = original(element)
        return got

    get_np_dtype._tilecomm_fixed = True
    _interp._get_np_dtype = get_np_dtype


_install_numpy2_index_fix()
_install_bf16_dot_fix()
_install_builtin_list_cache()
_install_direct_overflow_check()
_install_np_dtype_cache()


_INTERPRETED_HELPERS: dict = {}
# Triton's interpreter patches triton.language for a device function's module on every call of it
# (InterpretedFunction.__call__: inspect.getmembers over the language modules, ~1.5 ms a call), and nothing
# undoes those patches before the launch ends. So a helper whose language modules (tl, tl.core) are patched in
# this launch already runs its rewritten body directly. On CPU ranks the repeated patching was a third of an
# interpreted kernel's time (cProfile of the dispatch soak's loop, 2026-11-25).
_LANGS_PATCHED: set = set()  # ids of the language modules patched in the current interpreted launch
_LANGS_OF: dict = {}  # function -> ids of the language modules in its globals


def _langs(fn) -> frozenset:
    got = _LANGS_OF.get(fn)
    if got is None:
        got = _LANGS_OF[fn] = frozenset(id(v) for v in list(fn.__globals__.values()) if v is tl or v is tl.core)
    return got


def _run_helper(fn: InterpretedFunction, args, kwargs):
    """A device function called from an interpreted launch: patched once per launch, then run directly."""
    langs = _langs(fn.fn)
    if not langs <= _LANGS_PATCHED:
        _LANGS_PATCHED.update(langs)
        _PlainJitCallsInterpreted.helper_patched = True
        return fn(*args, **kwargs)
    try:
        return fn.rewrite()(*args, **kwargs)
    except Exception as e:  # as InterpretedFunction.__call__ reports it
        raise InterpreterError(repr(e)) from e


def _call_interpreted(self: JITFunction, *args, **kwargs):
    fn = _INTERPRETED_HELPERS.get(self.fn)
    if fn is None:
        fn = _INTERPRETED_HELPERS[self.fn] = InterpretedFunction(self.fn)
    return _run_helper(fn, args, kwargs)


class _PlainJitCallsInterpreted:
    """While an interpreted launch runs, a plain `triton.jit` function called from it (Triton's own
    `tl.zeros`, `tl.sum`, `tl.cdiv`... or a user's helper) runs interpreted too, as it would
    under TRITON_INTERPRET=1. Outside, JITFunction.__call__ keeps raising as usual.

    On exit the language modules are as they were on entry. Triton (3.6) patches the language modules of a
    device function on each call of it (InterpretedFunction.__call__) and never undoes it: a helper from a
    module with `tl.core` in its globals (Triton's own tl.sum, tl.cdiv...) left tl.core's builtins patched, and
    every later compile in the process failed ("'ir.value' object has no attribute 'dtype'"): a GPU process that
    ran a kernel on CPU tensors could compile no kernel afterwards (tests/test_jit_launch.py)."""

    helper_patched = False  # set by _run_helper when a helper patched modules the launch had not
    _MODULES = (tl, tl.core, tl.core.tensor, tl.math, tl.core.tensor_descriptor_base)

    def __init__(self, kernel_fn):
        self.kernel_fn = kernel_fn  # the launch patches its language modules (Triton's GridExecutor)

    def __enter__(self):
        _LANGS_PATCHED.clear()
        _LANGS_PATCHED.update(_langs(self.kernel_fn))
        self.saved = JITFunction.__call__
        self.modules = [(m, dict(vars(m))) for m in self._MODULES]
        _PlainJitCallsInterpreted.helper_patched = False
        JITFunction.__call__ = _call_interpreted

    def __exit__(self, *exc):
        JITFunction.__call__ = self.saved
        if _PlainJitCallsInterpreted.helper_patched:
            for module, entry in self.modules:
                now = vars(module)
                for name in [n for n in now if n not in entry]:
                    delattr(module, name)
                for name in [n for n, v in now.items() if entry[n] is not v]:
                    setattr(module, name, entry[name])


def _unwrap_interpreter_error(err: BaseException) -> BaseException:
    cause = err
    while isinstance(cause, InterpreterError) and cause.__cause__ is not None:
        cause = cause.__cause__
    return cause if isinstance(cause, TilecommError) else err


def _launch_on_cpu(args, kwargs) -> bool:
    if runtime.is_initialized():
        return runtime.current().backend == "cpu"
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    return all(t.device.type == "cpu" for t in tensors)


class TileKernel(JITFunction):
    """A Triton jit function that also runs on CPU ranks. See the module docstring.

    cpu_impl: for primitives only, the Python function the interpreter calls instead of `fn`.
    """

    def __init__(self, fn: Callable, cpu_impl: Optional[Callable] = None, **jit_kwargs):
        super().__init__(fn, **jit_kwargs)
        self._cpu_impl = cpu_impl
        self._interpreted: Optional[InterpretedFunction] = None

    def _interpreter(self) -> InterpretedFunction:
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted

    # Reached only from inside an interpreted kernel: compiled code never calls __call__.
    def __call__(self, *args, **kwargs):
        if self._cpu_impl is not None:
            return self._cpu_impl(*args, **kwargs)
        return _run_helper(self._interpreter(), args, kwargs)

    def run(self, *args, grid, warmup, **kwargs):
        if _launch_on_cpu(args, kwargs):
            if warmup:
                return None
            try:
                with _PlainJitCallsInterpreted(self.fn):
                    return self._interpreter().run(*args, grid=grid, warmup=False, **kwargs)
            except InterpreterError as err:
                unwrapped = _unwrap_interpreter_error(err)
                if unwrapped is err:
                    raise
                raise unwrapped.with_traceback(None) from None
        if runtime.is_initialized():  # kernels may use tilecomm.language: link NVSHMEM's device library
            runtime.check_errors()
            from .language import _gpu

            kwargs = _gpu.prepare_launch(kwargs)
        return super().run(*args, grid=grid, warmup=warmup, **kwargs)


def cdiv(x: int, y: int) -> int:
    """triton.cdiv for host code: Triton's own is a constexpr function since 3.5 (~2 µs a call on the host, a
    dozen calls per dispatch)."""
    return (x + y - 1) // y


def next_pow2(n: int) -> int:
    """triton.next_power_of_2 for host code (0 for n <= 0, as Triton's), without its constexpr-function call."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched as programmatic dependents (PDL: `launch_pdl=True`, with
    `tl.extra.cuda.gdc_launch_dependents` / `gdc_wait` in the kernels): CUDA devices of sm_90 and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def jit(fn: Optional[Callable] = None, **jit_kwargs):
    """Decorator: like `triton.jit`, and the kernel also runs on CPU ranks (see module docstring)."""
    if fn is None:
        return lambda f: TileKernel(f, **jit_kwargs)
    return TileKernel(fn, **jit_kwargs)


def _tma_scratch(size: int, alignment: int, stream):
    """Global scratch for device-built TMA descriptors (128 bytes per descriptor per program)."""
    device = "cuda" if stream is not None and torch.cuda.is_available() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def prepare_tma() -> None:
    """Install the descriptor scratch allocator for kernels that build TMA descriptors (a ContextVar: call it
    from each launching thread before such a launch)."""
    triton.set_allocator(_tma_scratch)


def _direct_launcher(kernel):
    """(the C launch function behind a compiled kernel's `run`, the arguments Triton's Python wrapper puts
    before the kernel's own, the global scratch bytes per program) when that wrapper adds nothing but the
    global scratch (Triton 3.5/3.6's CudaLauncher, recognised by its source): kernels that build TMA descriptors
    on the device need 128 bytes per descriptor per program, and `_run_compiled` allocates them as the wrapper
    does (one torch.empty on the launch's device, stream-ordered), without the wrapper's closures and lookups.
    None otherwise (profile scratch, another wrapper, over-aligned scratch): the caller goes through `kernel.run`."""
    import inspect

    launcher = kernel.run
    try:
        source = inspect.getsource(type(launcher).__call__)
    except (OSError, TypeError):
        return None
    expected = "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,"
    flat = " ".join(source.split())
    if expected not in flat or "global_scratch, profile_scratch, *args)" not in flat:
        return None
    size, align = getattr(launcher, "global_scratch_size", None), getattr(launcher, "global_scratch_align", None)
    if size is None or align is None or getattr(launcher, "profile_scratch_size", 1) or align > _ALLOC_ALIGN:
        return None
    per_program = size * getattr(launcher, "num_ctas", 1)
    prefix = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, kernel.packed_metadata, None, None,
              None)
    return launcher.launch, prefix, per_program


_ALLOC_ALIGN = 256  # torch's CUDA caching allocator returns blocks aligned to (at least) this many bytes


def _run_compiled(entry, grid, device_index: int, values) -> None:
    """Launch a CachedLaunch entry (run, function, prefix, constexprs, global scratch bytes per program) with the
    launcher's values on the current stream of the device, after raising any device error the runtime recorded."""
    run, function, prefix, consts, scratch = entry
    runtime.check_errors()
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    n = len(grid)
    gx, gy, gz = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
    if scratch:  # a fresh block per launch, as Triton's wrapper takes one (freed after the launch, stream-ordered)
        prefix = prefix[:2] + (torch.empty(gx * gy * gz * scratch, dtype=torch.int8, device=device_index),) + prefix[3:]
    run(gx, gy, gz, stream, function, *prefix, *values, *consts)


class CachedLaunch:
    """Launch one TileKernel the way a hot path needs: on GPUs, through the compiled kernel itself,
    skipping Triton's per-call argument binding, cache lookup and pointer queries (tens of µs for a
    kernel with twenty parameters), and, where Triton's launcher wrapper adds nothing but the global scratch
    (which `_run_compiled` then allocates), straight into its C launch function; on CPU ranks, the ordinary
    interpreted launch.

    `launch(grid, key, *args, **constexprs)`: `key` names the constexpr configuration (the caller's
    own, cheap to build: the same key must always come with the same constexprs). What Triton
    specialises the other arguments on (16-byte pointer alignment; an int's width and, unless the
    kernel says do_not_specialize, whether it is 1 or a multiple of 16) is added to it here. The
    first launch of a key compiles (or finds) the kernel the ordinary way. Owned by whoever launches
    (a CollectiveState, a Dispatcher's buffers), so its compiled kernels go with it.
    """

    enabled = True  # False: every launch takes Triton's ordinary path (the benchmark compares both)

    def __init__(self, fn: TileKernel):
        self.fn = fn
        self.names = [p.name for p in fn.params]
        self.plain_ints = [not p.do_not_specialize for p in fn.params]
        self.kernels: dict = {}
        self.registers: dict = {}  # (key, spec) -> (registers a thread, spilled bytes) of the compiled kernel

    def launch_keyed(self, grid, *args, **constexprs) -> None:
        """`launch` with the key made from the tensors' dtypes and the constexprs' values (a call site passes
        its constexprs in one order): for launch sites with no cheaper key of their own."""
        key = (tuple(a.dtype for a in args if isinstance(a, torch.Tensor)), tuple(constexprs.items()))
        self.launch(grid, key, *args, **constexprs)

    def values_and_spec(self, args) -> tuple:
        """(the launcher's values: tensors as int pointers, the launcher then skips its pointer query; the
        bits Triton specialises on, 3 per argument, the first argument's highest)."""
        values, spec = [], 0
        for a, plain in zip(args, self.plain_ints):
            if isinstance(a, torch.Tensor):
                a = a.data_ptr()
                spec = spec << 3 | (a & 15 == 0)
            elif isinstance(a, int):
                spec = spec << 3 | (-2147483648 <= a < 2147483648) | (plain and ((a == 1) << 1 | (a % 16 == 0) << 2))
            else:
                spec <<= 3
            values.append(a)
        return values, spec

    def bind(self, key, args, varying, **constexprs) -> "BoundLaunch":
        """A launcher for one call site whose arguments are fixed except those at positions `varying`."""
        return BoundLaunch(self, key, args, varying, constexprs)

    def launch(self, grid, key, *args, **constexprs) -> None:
        first = args[0]
        if not (self.enabled and isinstance(first, torch.Tensor) and first.is_cuda):
            self.fn[grid](*args, **constexprs)
            return
        values, spec = self.values_and_spec(args)
        entry = self.kernels.get((key, spec))
        if entry is None:
            kernel = self.fn[grid](*args, **constexprs)
            self.registers[(key, spec)] = (getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None))
            consts = [constexprs[n] for n in self.names[len(args):]]
            direct = _direct_launcher(kernel)
            if direct is None:
                prefix = (kernel.packed_metadata, None, None, None)
                self.kernels[(key, spec)] = (kernel.run, kernel.function, prefix, consts, 0)
            else:
                self.kernels[(key, spec)] = (direct[0], kernel.function, direct[1], consts, direct[2])
            return
        _run_compiled(entry, grid, first.get_device(), values)


class BoundLaunch:
    """One call site of a CachedLaunch whose arguments are the same on every call but a few (a Dispatcher's
    buffers and sizes are made once; the tokens, outputs and counts of a call vary): the fixed arguments'
    launcher values and specialisation bits are worked out here, once, so a launch converts only the
    varying ones, `launch(grid, *varying)` in the order of the positions given. The fixed tensors must
    outlive it (their pointers are kept). `values_and_spec` gives exactly what CachedLaunch's gives for the
    full argument list (tests/test_jit_launch.py). CPU ranks: the ordinary interpreted launch of the full
    list."""

    def __init__(self, launcher: CachedLaunch, key, args, varying, constexprs: dict):
        self.launcher, self.key, self.constexprs = launcher, key, constexprs
        self.varying = tuple(varying)
        # the varying places hold None here: a call's tensors (outputs of hundreds of MB) are not kept alive
        self.args = [None if i in self.varying else a for i, a in enumerate(args)]
        n = len(self.args)
        self.shifts = tuple(3 * (n - 1 - i) for i in self.varying)
        self.plain = tuple(launcher.plain_ints[i] for i in self.varying)
        self.values, self.fixed_spec = launcher.values_and_spec(self.args)  # None contributes no bits
        tensors = [a for a in self.args if isinstance(a, torch.Tensor)]
        self.device = tensors[0].device if tensors else torch.device("cpu")
        # read on every launch (torch.device.type costs ~0.5 µs a read on a CPU, more on the GPU machines' hosts)
        self.on_cuda, self.cuda_index = self.device.type == "cuda", self.device.index
        self.entries: dict = {}

    def values_and_spec(self, varying) -> tuple:
        values, spec = self.values.copy(), self.fixed_spec
        for i, shift, plain, a in zip(self.varying, self.shifts, self.plain, varying):
            if isinstance(a, torch.Tensor):
                a = a.data_ptr()
                spec |= (a & 15 == 0) << shift
            elif isinstance(a, int):
                spec |= ((-2147483648 <= a < 2147483648) | (plain and ((a == 1) << 1 | (a % 16 == 0) << 2))) << shift
            values[i] = a
        return values, spec

    def full_args(self, varying) -> list:
        args = self.args.copy()
        for i, a in zip(self.varying, varying):
            args[i] = a
        return args

    def launch(self, grid, *varying) -> None:
        if not (self.on_cuda and CachedLaunch.enabled):
            self.launcher.launch(grid, self.key, *self.full_args(varying), **self.constexprs)
            return
        values, spec = self.values_and_spec(varying)
        entry = self.entries.get(spec)
        if entry is None:  # the first launch of these bits: compiled (or found) by the CachedLaunch
            self.launcher.launch(grid, self.key, *self.full_args(varying), **self.constexprs)
            entry = self.launcher.kernels.get((self.key, spec))
            if entry is not None:
                self.entries[spec] = entry
            return
        _run_compiled(entry, grid, self.cuda_index, values)
