"""The C++ extensions' build name: a changed source or native header builds again."""
from efa_ep.kernels import cpp_ext


def test_build_name_follows_the_source_and_the_native_headers(tmp_path, monkeypatch):
    monkeypatch.setattr(cpp_ext, "NATIVE", str(tmp_path))
    src, hdr = tmp_path / "op.cpp", tmp_path / "lib.h"
    src.write_text('#include "lib.h"\n')
    hdr.write_text("struct rec { long a; };\n")
    first = cpp_ext._digest(str(src))
    assert cpp_ext._digest(str(src)) == first  # same content, same build
    hdr.write_text("struct rec { long a, b; };\n")  # a struct the source reads changed
    second = cpp_ext._digest(str(src))
    assert second != first
    src.write_text('#include "lib.h"\n// another line\n')
    third = cpp_ext._digest(str(src))
    assert third not in (first, second)
    (tmp_path / "notes.txt").write_text("not a header")  # other files do not matter
    assert cpp_ext._digest(str(src)) == third
