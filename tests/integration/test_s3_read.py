"""Read commands on s3:// against a real S3-compatible server on loopback (moto + s3fs).

Truth: the same commands on the local copy, the producer's reference state dict, and bytes
counted at s3fs's request function (not by ckptools).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptools
from ckptools.cli.main import cli
from ckptools.io.storage import RemoteReader
from ckptools.verify.checksums import write_checksums
from tests.support.checks import assert_reads_match_reference
from tests.support.s3 import GetCounter, objects, upload

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture
def fsdp2_on_s3(s3_bucket: str) -> str:
    url = f"{s3_bucket}/runs/fsdp2_ws2"
    upload(str(FIXTURES / "fsdp2_ws2"), url)
    return url


def test_inspect_on_s3_equals_local(fsdp2_on_s3: str) -> None:
    remote = ckptools.inspect(fsdp2_on_s3).to_dict()
    local = ckptools.inspect(str(FIXTURES / "fsdp2_ws2")).to_dict()
    remote.pop("path")
    local.pop("path")
    assert remote == local


def test_tensors_read_from_s3_match_reference(fsdp2_on_s3: str) -> None:
    assert assert_reads_match_reference(fsdp2_on_s3, FIXTURES / "fsdp2_ws2.reference.pt") > 0


def test_verify_diff_checksum_on_s3(fsdp2_on_s3: str) -> None:
    report = ckptools.verify(fsdp2_on_s3, check_finite=True)
    assert report.ok, [f.message for f in report.findings]
    sizes = objects(fsdp2_on_s3)
    assert 0 < report.bytes_read <= sizes["__0_0.distcp"] + sizes["__1_0.distcp"]
    assert ckptools.diff(fsdp2_on_s3, str(FIXTURES / "fsdp2_ws2")).identical
    sums = write_checksums(fsdp2_on_s3, quiet=True)
    assert sums.path == f"{fsdp2_on_s3}/.ckptools-checksums.json"
    assert ".ckptools-checksums.json" in objects(fsdp2_on_s3)
    again = ckptools.verify(fsdp2_on_s3)
    assert again.ok and again.checksums_checked


def test_verify_on_s3_reports_a_truncated_rank_file(fsdp2_on_s3: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem()
    key = fsdp2_on_s3.removeprefix("s3://") + "/__1_0.distcp"
    data = fs.cat_file(key)
    fs.pipe_file(key, data[: len(data) // 2])
    report = ckptools.verify(fsdp2_on_s3)
    kinds = {f.kind for f in report.findings}
    assert "truncated" in kinds
    assert any(f.rank == 1 for f in report.findings if f.kind == "truncated")


def test_cli_storage_options_carry_the_endpoint(
    fsdp2_on_s3: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The environment points nowhere; only --storage-options names the server.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    opts = json.dumps({"endpoint_url": s3_endpoint})
    runner = CliRunner()
    result = runner.invoke(cli, ["inspect", fsdp2_on_s3, "--json", "--storage-options", opts])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["format"] == "dcp"
    result = runner.invoke(cli, ["verify", fsdp2_on_s3, "--json", "--storage-options", opts])
    assert result.exit_code == 0, result.output
    per_protocol = json.dumps({"s3": {"endpoint_url": s3_endpoint}})
    result = runner.invoke(cli, ["inspect", fsdp2_on_s3, "--storage-options", per_protocol])
    assert result.exit_code == 0, result.output
    bad = runner.invoke(cli, ["inspect", fsdp2_on_s3, "--storage-options", "[1]"])
    assert bad.exit_code == 2 and "JSON object" in bad.output


def _ckpt(*args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh process (fsspec keeps its clients per process), with ``env``
    changed (None: unset)."""
    environ = {k: v for k, v in os.environ.items() if env.get(k, "") is not None}
    environ.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run(
        [sys.executable, "-m", "ckptools", *args], env=environ, capture_output=True, text=True
    )


def test_an_unreachable_store_or_missing_credentials_is_one_line(
    fsdp2_on_s3: str, tmp_path: Path
) -> None:
    # botocore's own errors (not OSErrors) came out of s3fs as tracebacks
    nowhere = "http://127.0.0.1:9"  # nothing listens there; one attempt, not botocore's five
    done = _ckpt("inspect", fsdp2_on_s3, AWS_ENDPOINT_URL=nowhere, AWS_MAX_ATTEMPTS="1")
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: {fsdp2_on_s3}: the object store could not be reached")
    assert "127.0.0.1:9" in done.stderr and len(done.stderr.splitlines()) == 1
    done = _ckpt("inspect", fsdp2_on_s3, "--json", AWS_ENDPOINT_URL=nowhere, AWS_MAX_ATTEMPTS="1")
    assert done.returncode == 1 and "could not be reached" in json.loads(done.stdout)["error"]
    no_credentials: dict[str, str | None] = dict.fromkeys(
        ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    )
    no_credentials |= {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    done = _ckpt("verify", fsdp2_on_s3, **no_credentials)
    assert done.returncode == 1, done.stderr
    assert "credentials" in done.stderr and len(done.stderr.splitlines()) == 1


def test_remote_reader_reads_only_what_is_asked(fsdp2_on_s3: str) -> None:
    local = FIXTURES / "fsdp2_ws2" / "__1_0.distcp"
    expected = local.read_bytes()
    with GetCounter() as counter, RemoteReader(fsdp2_on_s3, part_bytes=4096) as reader:
        assert reader.size("__1_0.distcp") == len(expected)
        assert reader.read("__1_0.distcp", 100, 10_000) == expected[100:10_100]
        buf = bytearray(20_000)
        reader.readinto("__1_0.distcp", 5, memoryview(buf))
        assert bytes(buf) == expected[5:20_005]
        reader.prefetch("__1_0.distcp", [(0, 64), (len(expected) - 64, 64)])
        fetched = counter.bytes
        assert reader.read("__1_0.distcp", 10, 20) == expected[10:30]  # served from prefetch
        assert counter.bytes == fetched
    assert counter.bytes == reader.bytes_fetched == 10_000 + 20_000 + 128
    # 10,000 and 20,000 bytes in 4 KiB parts, fetched concurrently
    assert counter.requests == 3 + 5 + 2
