"""The torch releases tpdp-verify runs on: an older one is refused in one line, before any
of torch's distributed modules is imported."""

import pytest

from tpdp_verify import cli, torch_release


@pytest.mark.parametrize("version, release", [("2.13.0+cpu", (2, 13)), ("2.15.0.dev20261101", (2, 15)),
                                              ("2.6.0", (2, 6)), ("3.0.1", (3, 0))])
def test_release_reads_major_and_minor(version, release):
    assert torch_release.release(version) == release


@pytest.mark.parametrize("argv", [["gate"], ["plan", "m:f", "--plan", "m:P", "--input", "m:i"]])
def test_an_older_torch_is_one_line_and_exit_2(monkeypatch, capsys, argv):
    real = torch_release.metadata.version
    monkeypatch.setattr(torch_release.metadata, "version", lambda name: "2.6.0" if name == "torch" else real(name))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this environment has torch 2.6.0" in err and "torch>=2.11" in err


def test_the_installed_torch_is_new_enough():
    torch_release.check()  # make test's torch: the lowest the suite runs on, or newer
