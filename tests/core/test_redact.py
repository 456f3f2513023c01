"""URLs as the tool prints and writes them (``visiontrain.core.redact``): passwords and tokens masked,
everything else kept, so that the message still says which database, bucket or server it means."""
from __future__ import annotations

import pytest

from visiontrain.core.redact import redact_url, scrub


@pytest.mark.parametrize("url, shown", [
    ("postgresql://u:secret@db.example:5432/study", "postgresql://u:***@db.example:5432/study"),
    ("postgresql://u:p@ss@db/study", "postgresql://u:***@db/study"),  # an @ in the password as typed
    ("mysql://u:pa/ss:w@db/study", "mysql://u:***@db/study"),  # a / and a : in it
    ("postgresql://u@db/study?password=secret&sslmode=require", "postgresql://u@db/study?password=***&sslmode=require"),
    ("https://bucket.s3.example/a.tar?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=abc&X-Amz-Date=1",
     "https://bucket.s3.example/a.tar?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Date=1"),
    ("http://tracker:5000?access_token=abc;user=me", "http://tracker:5000?access_token=***;user=me"),
])
def test_secrets_are_masked_and_the_rest_kept(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", [
    "s3://bucket/shards/a@b.tar",  # an @ in a path is no user info
    "http://host:8080/runs/a@b",
    "postgresql://u@db/study",  # a user without a password
    "sqlite:////data/study.db",
    "databricks",
    "/data/shards",
])
def test_a_url_without_secrets_is_unchanged(url):
    assert redact_url(url) == url


def test_a_message_that_quotes_the_url_or_its_password_is_scrubbed():
    url = "postgresql://u:p@ss-w0rd@db/study?token=t0ken-x"
    message = f"Could not parse SQLAlchemy URL from string '{url}' (password p@ss-w0rd, token t0ken-x)"
    scrubbed = scrub(message, url)
    assert "p@ss-w0rd" not in scrubbed and "t0ken-x" not in scrubbed
    assert "'postgresql://u:***@db/study?token=***'" in scrubbed


def test_a_message_that_quotes_a_piece_of_a_password_holding_an_at_is_scrubbed():
    """psycopg splits ``me:se@cret-x@host`` at the first ``@``: it reports a host ``cret-x@host``."""
    url = "postgresql://me:pa55@cret-x@127.0.0.1:1/none"
    message = "failed to resolve host 'cret-x@127.0.0.1': [Errno -2] Name or service not known (pa55)"
    scrubbed = scrub(message, url)
    assert "cret" not in scrubbed and "pa55" not in scrubbed, scrubbed
    assert "host '***@127.0.0.1'" in scrubbed
