"""Test-session set-up: Triton through its interpreter when there is no GPU, poisoned
outputs, and the shared helpers (tests/helpers*.py) and the benchmarks' modules (bench/)
importable from every test folder, and a small real corpus.

Under pytest-xdist (the README's ``-n auto``): as many workers as cores, fewer where the
memory would not hold them; each worker takes its share of the cores as torch threads; the
tests marked ``slow`` are scheduled first, and a module's tests that share a module-scoped
fixture run on one worker, so the fixture is built once.
"""

import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Both must be set before any module that defines Triton kernels is imported.
os.environ.setdefault("SMELT_POISON", "1")
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter (3.6) patches ``triton.language`` for a launch, then again at every
    call of a ``@triton.jit`` helper inside the kernel (``inspect.getmembers`` over five
    modules, a third of an interpreted attention kernel's time), never undoing the nested
    patches: the launch's own restore puts the originals back. Inside a launch whose patch
    covers the helper's language modules the nested patch changes nothing, so it is skipped.
    Where the interpreter's internals are not the ones this expects, nothing is changed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or not hasattr(getattr(interpreter, "_LangPatchScope", None), "restore"):
        return
    patched: set[int] = set()  # the language modules patched since the launch began

    class _NothingToRestore:
        def restore(self) -> None:
            pass

    def patch_once(fn):
        mine = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if mine and mine <= patched:
            return _NothingToRestore()
        scope = patch(fn)
        patched.update(mine)
        restore = scope.restore

        def restore_and_forget() -> None:  # only a launch restores its scope
            restore()
            patched.clear()

        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patch_once


def _numpy_types_once_per_name() -> None:
    """The interpreter's numpy dtype of a Triton type: it builds a 20-entry dict (hashing
    each type) at every call, on every op; the answer depends on the element's name only."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    stock_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if stock_np_dtype is None:
        return
    np_dtypes: dict[str, object] = {}

    def np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        name = element.name
        if name not in np_dtypes:
            np_dtypes[name] = stock_np_dtype(element)
        return np_dtypes[name]

    interpreter._get_np_dtype = np_dtype


def _overflow_checks_only_where_they_assert() -> None:
    """Every 32-bit integer add, sub and mul of a kernel computes its overflow check (both
    sides cast to int64, the op again, two comparisons: six interpreted ops, a quarter of an
    interpreted attention kernel's time) and hands it to ``device_assert``, which drops it
    unless the launch runs with ``debug``. Without ``debug`` the check is not computed:
    what runs and what is asserted are unchanged."""
    try:
        from triton.language import semantic
    except ImportError:
        return
    cls = getattr(semantic, "TritonSemantic", None)
    stock = getattr(cls, "binary_op_sanitize_overflow_impl", None)
    if stock is None:
        return

    @functools.wraps(stock)
    def sanitize(self, lhs, rhs, binary_op):
        if getattr(self.builder.options, "debug", True):
            return stock(self, lhs, rhs, binary_op)

    cls.binary_op_sanitize_overflow_impl = sanitize


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()
    _numpy_types_once_per_name()
    _overflow_checks_only_where_they_assert()

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS, os.path.join(os.path.dirname(_TESTS), "bench")]

import helpers  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

#: memory one worker may need at its peak (the largest in-process model tests)
WORKER_BYTES = 3 << 30

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _workers))
    # inductor's cache (and its precompiled header) per worker: two workers writing one
    # header at once compile against a torn file
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        os.path.join(
            tempfile.gettempdir(), f"torchinductor_smelt_{os.environ['PYTEST_XDIST_WORKER']}"
        ),
    )

from smelt_model.data.corpus import stdlib_root  # noqa: E402


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core this process may use, as many as the memory holds."""
    return max(1, min(len(os.sched_getaffinity(0)), _available_bytes() // WORKER_BYTES))


def pytest_collection_modifyitems(config, items):
    """The slow tests first: the rest fill in around them."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@functools.cache
def _shares_a_module_fixture(path: Path) -> bool:
    return path.suffix == ".py" and 'scope="module"' in path.read_text()


def pytest_xdist_make_scheduler(config, log):
    """Each test is a unit of work of its own, but a module whose tests share a module-scoped
    fixture is one unit (its fixture is built once, on one worker); units go out in the
    collection's order (the slow tests first)."""
    from xdist.scheduler import LoadScopeScheduling  # only under xdist, which calls this

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _shares_a_module_fixture(config.rootpath / path) else nodeid

    config.option.loadscopereorder = False
    return ModuleFixtureScheduling(config, log)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def triton_device():
    """The device Triton kernels run on here (skips the test where there is none)."""
    return helpers.triton_device()


@pytest.fixture(params=["torch", "cpu", "triton"])
def backend_device(request):
    """(backend, device) for each CPU-side backend: a test runs once per backend (Triton on
    its device, skipped where there is none)."""
    return request.param, helpers.device_for(request.param)


# a small real corpus for the data, trainer and analysis tests
CORPUS_MODULES = (
    "textwrap",
    "string",
    "glob",
    "fnmatch",
    "shlex",
    "bisect",
    "heapq",
    "colorsys",
    "keyword",
    "copy",
    "abc",
    "numbers",
)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A dozen standard-library modules, one document each."""
    root = tmp_path_factory.mktemp("corpus")
    for name in CORPUS_MODULES:
        shutil.copy(stdlib_root() / f"{name}.py", root / f"{name}.py")
    return root
