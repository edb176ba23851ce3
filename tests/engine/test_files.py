"""engine/files.py: atomic writes report errors on the file the caller named; JSON errors are whole."""

import pytest


def test_write_errors_name_the_target_not_the_temporary_file(tmp_path):
    """A folder that cannot be created, or a write that fails, is reported on the file asked for."""
    import pytest

    from lagom_megatron.engine.files import write_atomic, write_text_atomic

    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "sub" / "plan.json"
    with pytest.raises(OSError) as info:
        write_text_atomic(target, "x")
    assert info.value.filename == str(target) and ".tmp" not in str(info.value)

    def refuse(tmp):
        raise PermissionError(1, "Operation not permitted", tmp)

    with pytest.raises(PermissionError) as info:
        write_atomic(tmp_path / "plan.json", refuse)
    assert str(info.value) == f"[Errno 1] Operation not permitted: '{tmp_path / 'plan.json'}'"
    assert list(tmp_path.glob(".plan.json.*")) == []  # the temporary file is removed


def test_json_error_is_whole_with_its_position(tmp_path):
    from lagom_megatron.engine.files import read_json

    path = tmp_path / "plan.json"
    path.write_text('{\n "a": 1,\n "b": "cut off')
    with pytest.raises(ValueError) as info:
        read_json(path)
    # json's own message is "Unterminated string starting at" and stops there; the position follows
    assert str(info.value) == f"{path}: invalid JSON at line 3 column 7 (char 17): Unterminated string starting here"
    path.write_text('{"a": 1,}')
    with pytest.raises(ValueError) as info:
        read_json(path)
    assert str(info.value).startswith(f"{path}: invalid JSON at line 1 column 9 (char 8): ")
    assert "property name" in str(info.value)  # json's message, whole
