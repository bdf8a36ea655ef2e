"""The two export formats' directories read back (backends/stablehlo.py, backends/ct2.py):
a missing or older metadata file is one ValueError that names the command to run."""

import json

import pytest

from attention_jax.backends import ct2, ct2_export, stablehlo


@pytest.mark.parametrize(
    "read, name, version, flag",
    [
        (stablehlo.ExportedTranslator.load, stablehlo.METADATA, stablehlo.FORMAT_VERSION, "export"),
        (ct2.read_settings, ct2_export.DECODING_JSON, ct2_export.FORMAT_VERSION, "export_ct2"),
    ],
)
def test_a_missing_or_older_export_names_the_command_that_writes_it(
    tmp_path, read, name, version, flag
):
    writer = f"`decode.py --workdir=W --{flag}=DIR`"
    with pytest.raises(ValueError, match=f"{name} is missing: is .* written by {writer}"):
        read(str(tmp_path))
    (tmp_path / name).write_text(json.dumps({"format_version": version - 1}))
    with pytest.raises(ValueError) as e:
        read(str(tmp_path))
    message = str(e.value)
    assert f"format version {version - 1}, this version reads {version}" in message
    assert message.endswith(f"write it again with {writer}")
    (tmp_path / name).write_text('{"format_version": ')  # a write cut short
    cut = f"{name} is not valid JSON .*write it again with {writer}"
    with pytest.raises(ValueError, match=cut):
        read(str(tmp_path))
