"""dynamiq.Control against a dynamiqd that requires an operator token (docs/security.md)."""

import os

import dynamiq
import pytest

from conftest import dynamiqd_supports

TOKEN = "python-operator-token-0123456789"


def write_secret(workdir, name, text, mode=0o600):
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


def test_control_needs_the_token(cluster, workdir, monkeypatch):
    if not dynamiqd_supports("operator_token_file"):
        pytest.skip("dynamiqd without --operator_token_file")
    monkeypatch.delenv("DQ_TOKEN_FILE", raising=False)
    token_file = write_secret(workdir, "token", TOKEN + "\n")
    c = cluster(1, operator_token_file=token_file)

    with pytest.raises(dynamiq.Error) as refused:
        dynamiq.Control(c.control).status()
    assert refused.value.code == "UNAUTHENTICATED" and "operator token" in refused.value.message
    with pytest.raises(dynamiq.Error) as wrong:
        dynamiq.Control(c.control, token="not-the-token-0123456789").status()
    assert wrong.value.code == "UNAUTHENTICATED"

    assert dynamiq.Control(c.control, token=TOKEN).status()["num_nodes"] == 1
    assert dynamiq.Control(c.control, token_file=token_file).status()["num_nodes"] == 1
    monkeypatch.setenv("DQ_TOKEN_FILE", token_file)
    assert dynamiq.Control(c.control).status()["num_nodes"] == 1


def test_token_file_must_be_owner_only(workdir, monkeypatch):
    monkeypatch.delenv("DQ_TOKEN_FILE", raising=False)
    loose = write_secret(workdir, "loose", TOKEN, mode=0o644)
    with pytest.raises(dynamiq.Error) as bad:
        dynamiq.Control("127.0.0.1:1", token_file=loose)
    assert bad.value.code == "FAILED_PRECONDITION" and "0644" in bad.value.message
