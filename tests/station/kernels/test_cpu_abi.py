"""The C library's interface (station/kernels/cpu_abi.h) and its ctypes mirror agree.

A probe compiled against the header with the build's compiler prints every struct's size,
every field's offset and the header's constants. Each ``ctypes.Structure`` of
``cpu_kernels`` and ``cpu_step`` names a struct of the header (``_c_name_``), lists the
header's fields in the header's order under the same names, and has the same size and
offsets; every struct of the header has its mirror; each function Python calls has a
prototype with the header's number of arguments, its struct pointers the mirrors'. And a
struct the C side refuses comes back as a status, not a crash.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest

from station.kernels import cpu_kernels, cpu_step, q4_tiles
from station.kernels.cpu_kernels import HEADER, Q8Product, Status, compiler, load_library

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler here (cc, gcc or $CC)")

CONSTANTS = {"GNOSIS_GROUP": cpu_kernels.GROUP, "GNOSIS_STEP_MAX_WIDTH": cpu_step.MAX_WIDTH,
             "GNOSIS_STEP_MAX_HEAD_DIM": cpu_step.MAX_HEAD_DIM, "GNOSIS_Q4_TILE": q4_tiles.TILE,
             "GNOSIS_STEP_MAX_ROWS": cpu_step.MAX_ROWS,
             **{f"GNOSIS_{status.name}": int(status) for status in Status}}


def _code(text: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def _header_structs() -> dict[str, list[str]]:
    """Each ``typedef struct { ... } name;`` of the header: its field names, in order."""
    structs = {}
    for body, name in re.findall(r"typedef struct\s*\{(.*?)\}\s*(\w+)\s*;", _code(HEADER.read_text()), re.S):
        fields = []
        for declaration in filter(str.strip, body.split(";")):  # "const float *cos, *sin"
            fields += [re.findall(r"\w+", declarator)[-1] for declarator in declaration.split(",")]
        structs[name] = fields
    return structs


def _header_functions() -> dict[str, tuple[str, list[str]]]:
    """Each function the header declares (one a line): its return type and its parameters'
    types (``[]`` for ``void``), spaces normalised: ``"const gnosis_step_t *"``."""
    functions = {}
    for line in _code(HEADER.read_text()).splitlines():
        found = re.fullmatch(r"\s*([A-Za-z_][\w\s*]*?)\s*\b(gnosis_\w+)\(([^)]*)\);\s*", line)
        if found:
            returns, name, params = found.groups()
            params = [] if params.strip() == "void" else params.split(",")
            functions[name] = (" ".join(returns.split()),
                               [re.sub(r"\s*\w+$", "", " ".join(p.split())) for p in params])
    return functions


def _mirrors() -> dict[str, type[ctypes.Structure]]:
    found = {}
    for module in (cpu_kernels, cpu_step, q4_tiles):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, ctypes.Structure) and obj.__module__ == module.__name__:
                found[obj._c_name_] = obj
    return found


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict[str, int]:
    """``{"sizeof NAME": n, "offsetof NAME.FIELD": n, CONSTANT: value}`` as the compiler has them."""
    lines = [f'printf("sizeof {name} %zu\\n", sizeof({name}));' for name in [*_header_structs(), "gnosis_status_t"]]
    lines += [f'printf("offsetof {name}.{field} %zu\\n", offsetof({name}, {field}));'
              for name, fields in _header_structs().items() for field in fields]
    lines += [f'printf("{constant} %ld\\n", (long)({constant}));' for constant in CONSTANTS]
    lines.append('printf("GNOSIS_STEP_MAX_ROWS %ld\\n", (long)GNOSIS_STEP_MAX_ROWS);')
    root = tmp_path_factory.mktemp("abi")
    source = root / "probe.c"
    source.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "cpu_abi.h"\n'
                      "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    # the build's compiler and target, the library's own header
    subprocess.run([compiler(), "-march=native", "-I", str(HEADER.parent), "-o", str(root / "probe"), str(source)],
                   check=True, capture_output=True, text=True, timeout=120)
    out = subprocess.run([str(root / "probe")], check=True, capture_output=True, text=True, timeout=30).stdout
    return {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in out.splitlines()}


def test_every_struct_of_the_header_has_its_mirror_and_no_other():
    assert set(_mirrors()) == set(_header_structs())


@pytest.mark.parametrize("name", sorted(_header_structs()))
def test_a_mirror_has_the_headers_fields_sizes_and_offsets(probed, name):
    mirror = _mirrors()[name]
    fields = [field for field, *_ in mirror._fields_]
    assert fields == _header_structs()[name]
    assert ctypes.sizeof(mirror) == probed[f"sizeof {name}"]
    for field in fields:
        assert getattr(mirror, field).offset == probed[f"offsetof {name}.{field}"], field


def test_the_constants_are_the_headers(probed):
    assert {constant: probed[constant] for constant in CONSTANTS} == CONSTANTS
    assert probed["sizeof gnosis_status_t"] == ctypes.sizeof(ctypes.c_int)  # the prototypes' restype
    assert 1 <= cpu_step.STEP_ROWS <= probed["GNOSIS_STEP_MAX_ROWS"]


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    lib = load_library(tmp_path_factory.mktemp("lib"))
    assert lib is not None
    return q4_tiles.declare_q4(cpu_step.declare_step(lib))


def _ctype(c_type: str) -> object:
    """The ctypes type a prototype gives a C type of the header."""
    struct = re.fullmatch(r"(?:const )?(gnosis_\w+_t) \*", c_type)
    if struct and struct[1] in _mirrors():
        return ctypes.POINTER(_mirrors()[struct[1]])
    return {"void": None, "gnosis_status_t": ctypes.c_int, "int32_t": ctypes.c_int32,
            "const char *": ctypes.c_char_p, "const float *": ctypes.c_void_p, "float *": ctypes.c_void_p,
            "gnosis_step_t **": ctypes.POINTER(ctypes.c_void_p),
            "gnosis_step_t *": ctypes.c_void_p, "const gnosis_step_t *": ctypes.c_void_p}[c_type]


def test_each_function_python_calls_has_the_headers_prototype(lib):
    functions = _header_functions()
    assert set(functions) == {"gnosis_simd", "gnosis_q8_linear", "gnosis_q8_columns", "gnosis_step_create",
                              "gnosis_step_free", "gnosis_step_threads", "gnosis_step_run", "gnosis_step_head",
                              "gnosis_q4_simd", "gnosis_attention_takes", "gnosis_q4_linear"}
    del functions["gnosis_q8_columns"]  # cpu_step.c's, not called from Python
    for name, (returns, params) in functions.items():
        function = getattr(lib, name)
        assert function.restype is _ctype(returns), name
        assert list(function.argtypes) == [_ctype(param) for param in params], name


def test_refused_structs_come_back_as_a_status(lib):
    handle = ctypes.c_void_p(1)
    assert lib.gnosis_step_create(ctypes.byref(cpu_step.StepConfig()), ctypes.byref(handle)) == Status.BAD_ARGUMENT
    assert handle.value is None  # NULL: nothing to free
    product = Q8Product(rows=1, out_features=1, in_features=33)  # not whole groups of 32
    assert lib.gnosis_q8_linear(ctypes.byref(product), 1) == Status.BAD_ARGUMENT


def test_the_header_is_part_of_the_librarys_key(tmp_path, monkeypatch):
    """A change to the header alone builds another library (the structs may have moved)."""
    monkeypatch.setattr(cpu_kernels, "_loaded", {})  # not this process's libraries of other tests
    load_library(tmp_path)
    header = tmp_path / "cpu_abi.h"
    header.write_text(HEADER.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(cpu_kernels, "HEADER", Path(header))
    load_library(tmp_path)
    assert len(list((tmp_path / "kernels").glob("cpu_kernels-*.so"))) == 2
