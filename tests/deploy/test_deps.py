"""scripts/deps.sh checks each package by what the build and the tests do
with it: a command of the right name that cannot do the work is reported
missing, with the Debian package that brings the capability."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPS = ROOT / "scripts" / "deps.sh"

# The command each capability is checked with, and the Debian package that
# must be named when that command cannot do its work.
CAPABILITIES = [
    ("cc", "gcc", "fleet"),
    ("protoc", "libprotobuf-dev", "fleet"),
    ("etcd", "etcd-server", "fleet"),
    ("curl", "curl", "fleet"),
    ("g++", "g++", "llama"),
    ("cmake", "cmake", "llama"),
    ("ninja", "ninja-build", "llama"),
    ("python3", "python3-pip", "llama"),
    ("python3", "python3-venv", "test"),
    ("chromium", "chromium", "test"),
    ("chromedriver", "chromium-driver", "test"),
]


def check(group, env=None):
    return subprocess.run(["bash", str(DEPS), "--check", group], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_everything_the_suite_needs_is_here():
    result = check("test")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command,package,group", CAPABILITIES)
def test_a_command_that_cannot_do_the_work_is_reported_missing(tmp_path, command, package, group):
    # The impostor answers to its name, as `command -v` would see it, and
    # prints what a protoc without the well-known types prints.
    impostor = tmp_path / command
    impostor.write_text("#!/bin/sh\necho 'google/protobuf/descriptor.proto: File not found.' >&2\nexit 1\n")
    impostor.chmod(impostor.stat().st_mode | stat.S_IXUSR)
    result = check(group, {"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert result.returncode == 1, result.stderr
    assert package in result.stderr, result.stderr


def test_protoc_without_the_well_known_types_is_libprotobuf_dev(tmp_path):
    # The real protoc, copied away from the include directory it finds the
    # well-known types in (../include beside itself), as on a machine with
    # protobuf-compiler installed without its recommends.
    protoc = subprocess.run(["bash", "-c", "command -v protoc"], capture_output=True, text=True).stdout.strip()
    assert protoc, "protoc is not installed: scripts/deps.sh fleet installs it"
    bare = tmp_path / "bin"
    bare.mkdir()
    shutil.copy(protoc, bare / "protoc")
    result = check("fleet", {"PATH": f"{bare}:{os.environ['PATH']}"})
    assert result.returncode == 1, result.stderr
    assert "libprotobuf-dev" in result.stderr, result.stderr
    assert "etcd-server" not in result.stderr, result.stderr


def test_an_llvm_profdata_of_another_llvm_is_reported_missing(tmp_path):
    # rustc's profiles are read only by its own LLVM's llvm-profdata: one
    # of another major answers to the name the check runs, and is not it.
    version = subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout
    major = next(line.split()[-1].split(".")[0] for line in version.splitlines() if line.startswith("LLVM version"))
    impostor = tmp_path / f"llvm-profdata-{major}"
    impostor.write_text("#!/bin/sh\necho 'Debian LLVM version 14.0.6'\n")
    impostor.chmod(impostor.stat().st_mode | stat.S_IXUSR)
    result = check("pgo", {"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert result.returncode == 1, result.stderr
    assert f"llvm-{major}" in result.stderr, result.stderr
    assert check("pgo").returncode == 0


def test_an_unknown_group_is_refused():
    result = check("everything")
    assert result.returncode == 2
    assert "unknown argument" in result.stderr
