"""scripts/pgstack.py's pure parts: the PostgreSQL config files, the SQLAlchemy URL, the SCRAM verifier, the psql
script and command, the readiness probe's protocol, and the 0600 password file."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import stat
import struct
from pathlib import Path

import pgstack  # pytest puts scripts/ on sys.path (pythonpath in pyproject.toml)
import pytest


def conf_settings(text: str) -> dict[str, str]:
    settings = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()  # no value of ours contains a '#'
        if line:
            key, value = (part.strip() for part in line.split("=", 1))
            settings[key] = value
    return settings


# ---------------------------------------------------------------------------------------------- postgresql.conf
@pytest.mark.parametrize(
    "key, expected",
    [
        ("listen_addresses", "'127.0.0.1'"),  # loopback only, never '*'
        ("port", "55432"),
        ("unix_socket_directories", "'/var/lib/hybridflow/postgres/data/run'"),
        ("unix_socket_permissions", "0700"),
        ("max_connections", "200"),
        ("password_encryption", "scram-sha-256"),
        ("shared_buffers", "256MB"),
        ("fsync", "on"),
        ("synchronous_commit", "on"),
        ("full_page_writes", "on"),
        ("max_parallel_workers_per_gather", "0"),
        ("logging_collector", "off"),  # stderr goes to the log file the server is started with
        ("timezone", "'UTC'"),
    ],
)
def test_postgresql_conf_settings(key, expected):
    text = pgstack.postgresql_conf(55432, Path("/var/lib/hybridflow/postgres/data/run"))
    assert conf_settings(text)[key] == expected


def test_postgresql_conf_sets_each_key_once():
    text = pgstack.postgresql_conf(5433, Path("/d/run"))
    keys = [line.split("=", 1)[0].strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    "sock_dir, port, error",
    [
        ("/tmp/it's", 5433, "unsupported character"),
        ("/tmp/back\\slash", 5433, "unsupported character"),
        ("/" + "x" * 100, 5433, "longer than 107"),
    ],
)
def test_postgresql_conf_refuses_bad_socket_dirs(sock_dir, port, error):
    with pytest.raises(ValueError, match=error):
        pgstack.postgresql_conf(port, Path(sock_dir))


# ---------------------------------------------------------------------------------------------- pg_hba.conf
def hba_rules(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_pg_hba_rules():
    assert hba_rules(pgstack.pg_hba_conf()) == [
        ["local", "all", "postgres", "peer"],
        ["host", "airflow", "airflow", "127.0.0.1/32", "scram-sha-256"],
    ]


def test_pg_hba_admits_each_further_login_to_its_own_database_only():
    assert hba_rules(pgstack.pg_hba_conf(more=[("mlflow", "mlflow")]))[1:] == [
        ["host", "airflow", "airflow", "127.0.0.1/32", "scram-sha-256"],
        ["host", "mlflow", "mlflow", "127.0.0.1/32", "scram-sha-256"],
    ]


@pytest.mark.parametrize("forbidden", ["trust", "password", "md5", "0.0.0.0", "::", "samenet", "all all"])
def test_pg_hba_allows_nothing_weak_or_remote(forbidden):
    assert forbidden not in " ".join(" ".join(rule) for rule in hba_rules(pgstack.pg_hba_conf()))


@pytest.mark.parametrize(
    "role, database", [("air flow", "airflow"), ("airflow", "db;drop"), ("Airflow", "x"), ("", "x")]
)
def test_pg_hba_refuses_odd_names(role, database):
    with pytest.raises(ValueError):
        pgstack.pg_hba_conf(role, database)
    with pytest.raises(ValueError):
        pgstack.pg_hba_conf(more=[(role, database)])


# ---------------------------------------------------------------------------------------------- libpq password file
@pytest.mark.parametrize(
    "password, line",
    [
        ("plain-Pw_09", "127.0.0.1:5433:mlflow:mlflow:plain-Pw_09\n"),
        ("a:b\\c", "127.0.0.1:5433:mlflow:mlflow:a\\:b\\\\c\n"),  # ':' and a backslash escaped, as libpq expects
    ],
)
def test_pgpass_line(password, line):
    assert pgstack.pgpass_line(password, 5433, "mlflow", "mlflow") == line


def test_pgpass_line_refuses_line_breaks():
    with pytest.raises(ValueError):
        pgstack.pgpass_line("a\nb", 5433, "mlflow", "mlflow")


def test_provisioned_stamp_keeps_airflows_name_and_gives_others_their_own():
    assert pgstack.provisioned_stamp(pgstack.AIRFLOW_LOGIN) == pgstack.PROVISIONED_STAMP
    assert pgstack.provisioned_stamp(pgstack.Login("mlflow", "mlflow", "postgres-mlflow")) == (
        f"{pgstack.PROVISIONED_STAMP}-mlflow")


# ---------------------------------------------------------------------------------------------- the URL
@pytest.mark.parametrize(
    "password, port, expected",
    [
        ("s3cret_-A9", 5433, "postgresql+psycopg2://airflow:s3cret_-A9@127.0.0.1:5433/airflow"),
        ("p@ss:w/rd", 55432, "postgresql+psycopg2://airflow:p%40ss%3Aw%2Frd@127.0.0.1:55432/airflow"),
        ("50%off", 5433, "postgresql+psycopg2://airflow:50%25off@127.0.0.1:5433/airflow"),
        ("$HOME#x?y", 5433, "postgresql+psycopg2://airflow:%24HOME%23x%3Fy@127.0.0.1:5433/airflow"),
        ("a b+c", 5433, "postgresql+psycopg2://airflow:a%20b%2Bc@127.0.0.1:5433/airflow"),
    ],
)
def test_sqlalchemy_url_quotes_the_password(password, port, expected):
    assert pgstack.sqlalchemy_url(password, port) == expected


@pytest.mark.parametrize("password", ["plain", "p@ss:w/rd", "50%off", "$HOME", "a b+c", "q'\"\\", "ünï"])
def test_sqlalchemy_url_parses_back(password):
    make_url = pytest.importorskip("sqlalchemy.engine").make_url
    url = make_url(pgstack.sqlalchemy_url(password, 5433))
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
        "postgresql+psycopg2", "airflow", password, "127.0.0.1", 5433, "airflow")


def test_sqlalchemy_url_has_nothing_for_airflows_env_expansion():
    # Airflow expands $VAR and ~ in AIRFLOW__* values: the quoted URL carries no `$`.
    assert "$" not in pgstack.sqlalchemy_url("$USER${HOME}", 5433)


# ---------------------------------------------------------------------------------------------- SCRAM verifier
RFC7677 = {  # RFC 7677, section 3: user "user", password "pencil"
    "salt": "W22ZaJ0SNY7soEsUEjb6gQ==",
    "auth_message": "n=user,r=rOprNGfwEbeRWgbNEkqO,"
                    "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096,"
                    "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0",
    "client_proof": "dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=",
    "server_signature": "6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=",
}


def parse_verifier(verifier: str) -> tuple[int, bytes, bytes, bytes]:
    match = re.fullmatch(r"SCRAM-SHA-256\$(\d+):([^$]+)\$([^:]+):(.+)", verifier)
    assert match, verifier
    iterations, salt, stored, server = match.groups()
    return int(iterations), *(base64.b64decode(x) for x in (salt, stored, server))


def test_scram_verifier_matches_rfc7677():
    iterations, salt, stored_key, server_key = parse_verifier(
        pgstack.scram_verifier("pencil", base64.b64decode(RFC7677["salt"])))
    auth = RFC7677["auth_message"].encode()
    assert iterations == 4096
    assert base64.b64encode(hmac.new(server_key, auth, "sha256").digest()).decode() == RFC7677["server_signature"]
    # The client's proof, unmasked with the client signature, hashes to the stored key.
    signature = hmac.new(stored_key, auth, "sha256").digest()
    client_key = bytes(a ^ b for a, b in zip(base64.b64decode(RFC7677["client_proof"]), signature, strict=True))
    assert hashlib.sha256(client_key).digest() == stored_key


def test_scram_verifier_salts_each_time_and_hides_the_password():
    first, second = pgstack.scram_verifier("hunter2hunter2"), pgstack.scram_verifier("hunter2hunter2")
    assert first != second
    assert "hunter2" not in first
    assert len(parse_verifier(first)[1]) == 16


@pytest.mark.parametrize("password", ["", "ünïcode", "tab\there", "new\nline"])
def test_scram_verifier_refuses_what_saslprep_would_change(password):
    with pytest.raises(ValueError):
        pgstack.scram_verifier(password)


# ---------------------------------------------------------------------------------------------- psql
@pytest.mark.parametrize(
    "value, expected",
    [
        ("plain", "'plain'"),
        ("it's", "'it\\'s'"),
        ("back\\slash", "'back\\\\slash'"),
        ("two\nlines", "'two\\nlines'"),
        ("tab\tcr\r", "'tab\\tcr\\r'"),
        (":'x' \\gexec", "':\\'x\\' \\\\gexec'"),
        ("SCRAM-SHA-256$4096:abc=$def:ghi", "'SCRAM-SHA-256$4096:abc=$def:ghi'"),
    ],
)
def test_psql_quote(value, expected):
    assert pgstack.psql_quote(value) == expected


def test_psql_quote_refuses_nul():
    with pytest.raises(ValueError):
        pgstack.psql_quote("a\0b")


def test_provision_script_takes_names_as_psql_variables():
    verifier = pgstack.scram_verifier("correct-horse")
    script = pgstack.provision_script(verifier)
    lines = script.splitlines()
    assert lines[0] == "\\set ON_ERROR_STOP on"
    assert lines[1] == f"\\set verifier '{verifier}'"
    assert "correct-horse" not in script
    assert "airflow" not in script  # role and database arrive as :'role' / :"role" and :'db' / :"db"
    for fragment in ("CREATE ROLE %I", "ALTER ROLE :\"role\"", "PASSWORD :'verifier'", "NOSUPERUSER",
                     "ENCODING %L TEMPLATE template0", "ALTER DATABASE :\"db\" OWNER TO :\"role\"", "\\gexec"):
        assert fragment in script


@pytest.mark.parametrize(
    "variables, tail",
    [
        ({}, ["-f", "-"]),
        ({"role": "airflow", "db": "airflow"}, ["-v", "role=airflow", "-v", "db=airflow", "-f", "-"]),
        ({"x": "a b; rm -rf /"}, ["-v", "x=a b; rm -rf /", "-f", "-"]),  # one argv item: no shell involved
    ],
)
def test_psql_command(variables, tail):
    cmd = pgstack.psql_command(Path("/d/run"), 5433, variables)
    assert cmd[:5] == ["runuser", "-u", "postgres", "--", f"/usr/lib/postgresql/{pgstack.PG_VERSION}/bin/psql"]
    assert cmd[cmd.index("-h") + 1] == "/d/run" and cmd[cmd.index("-p") + 1] == "5433"
    assert "-X" in cmd and "ON_ERROR_STOP=1" in cmd
    assert cmd[-len(tail):] == tail


@pytest.mark.parametrize("name", ["bad name", "x=y", "1x", ""])
def test_psql_command_refuses_odd_variable_names(name):
    with pytest.raises(ValueError):
        pgstack.psql_command(Path("/d/run"), 5433, {name: "v"})


# ---------------------------------------------------------------------------------------------- postmaster.pid
def test_parse_postmaster_pid():
    text = ("4242\n/var/lib/hybridflow/postgres/data\n1733250000\n5433\n/var/lib/hybridflow/postgres/data/run\n"
            "127.0.0.1\n  5433001     32768\nready   \n")
    assert pgstack.parse_postmaster_pid(text) == {
        "pid": "4242", "data_dir": "/var/lib/hybridflow/postgres/data", "start_time": "1733250000", "port": "5433",
        "socket_dir": "/var/lib/hybridflow/postgres/data/run", "listen": "127.0.0.1",
        "shmem_key": "5433001     32768", "status": "ready",
    }


def test_parse_postmaster_pid_while_starting():
    assert pgstack.parse_postmaster_pid("4242\n/d\n1\n5433\n") == {
        "pid": "4242", "data_dir": "/d", "start_time": "1", "port": "5433"}


# ---------------------------------------------------------------------------------------------- readiness probe
def test_startup_message_layout():
    msg = pgstack.startup_message("airflow", "airflow")
    length, version = struct.unpack("!ii", msg[:8])
    assert length == len(msg) and version == 196608  # protocol 3.0
    assert msg[8:].split(b"\0")[:4] == [b"user", b"airflow", b"database", b"airflow"]
    assert msg.endswith(b"\0\0")


def error_response(code: str, message: str = "m") -> bytes:
    body = b"".join(f"{k}{v}\0".encode() for k, v in (("S", "FATAL"), ("C", code), ("M", message))) + b"\0"
    return b"E" + struct.pack("!i", 4 + len(body)) + body


@pytest.mark.parametrize(
    "reply, verdict",
    [
        (b"", None),
        (b"R\x00\x00\x00\x17\x00\x00\x00\x0aSCRAM-SHA-256\x00\x00", True),  # SASL: accepting
        (b"R", True),
        (error_response("57P03", "the database system is starting up"), False),
        (error_response("57P03", "the database system is shutting down"), False),
        (error_response("28P01", "password authentication failed"), True),  # up, only refused us
        (error_response("28000", "no pg_hba.conf entry"), True),
        (error_response("53300", "too many connections"), True),
        (error_response("57P03")[:7], None),  # need the rest of the message
        (b"E\x00", None),
        (b"HTTP/1.1 400 Bad Request\r\n", False),  # not PostgreSQL on that port
    ],
)
def test_server_accepts(reply, verdict):
    assert pgstack.server_accepts(reply) is verdict


# ---------------------------------------------------------------------------------------------- password file
def test_ensure_password_creates_a_0600_file_once(tmp_path, monkeypatch):
    old = os.umask(0)  # even with no umask the file is never wider than 0600
    try:
        secrets_dir = tmp_path / "secrets"
        first = pgstack.ensure_password(secrets_dir)
        second = pgstack.ensure_password(secrets_dir)
    finally:
        os.umask(old)
    path = secrets_dir / pgstack.PASSWORD_FILE
    assert first == second and len(first) >= 32
    assert re.fullmatch(r"[A-Za-z0-9_-]+", first)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
    assert [p.name for p in secrets_dir.iterdir()] == [pgstack.PASSWORD_FILE]  # no temporary file left


def test_ensure_password_names_its_file(tmp_path):
    first = pgstack.ensure_password(tmp_path, name="postgres-mlflow")
    assert (tmp_path / "postgres-mlflow").read_text().strip() == first
    assert not (tmp_path / pgstack.PASSWORD_FILE).exists()
    assert pgstack.ensure_password(tmp_path) != first  # the airflow role's is another


def test_ensure_password_keeps_an_existing_password(tmp_path):
    (tmp_path / pgstack.PASSWORD_FILE).write_text("given-password\n")
    assert pgstack.ensure_password(tmp_path) == "given-password"


def test_ensure_password_refuses_an_empty_file(tmp_path):
    (tmp_path / pgstack.PASSWORD_FILE).write_text("\n")
    with pytest.raises(RuntimeError, match="empty"):
        pgstack.ensure_password(tmp_path)


def test_provisioned_digest_changes_with_each_part():
    base = pgstack.provisioned_digest("airflow", "airflow", "pw")
    assert base == pgstack.provisioned_digest("airflow", "airflow", "pw")
    assert len({base, pgstack.provisioned_digest("airflow", "airflow", "pw2"),
                pgstack.provisioned_digest("airflowx", "airflow", "pw"),
                pgstack.provisioned_digest("airflow", "airflowx", "pw")}) == 4
    assert "pw" not in base


# ---------------------------------------------------------------------------------------------- paths
@pytest.mark.parametrize(
    "mode, owner, group, uid, gids, expected",
    [
        (0o755, 0, 0, 101, {104}, True),  # root's 0755 directory: others may search it
        (0o700, 0, 0, 101, {104}, False),  # root's private directory (.state/): not for postgres
        (0o750, 0, 104, 101, {104}, True),  # group postgres may search it
        (0o750, 0, 0, 101, {104}, False),  # another group's
        (0o711, 0, 0, 101, set(), True),  # search permission is enough
        (0o070, 101, 104, 101, {104}, False),  # the owner's bits decide for the owner, not the group's
        (0o700, 101, 104, 101, {104}, True),
    ],
)
def test_traversable(mode, owner, group, uid, gids, expected):
    assert pgstack.traversable(stat.S_IFDIR | mode, owner, group, uid, gids) is expected


def test_blocking_ancestor_names_the_first_closed_directory(tmp_path):
    me = os.getuid()
    assert pgstack.blocking_ancestor(tmp_path / "data", me, set()) is None
    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "a" / "b").mkdir(mode=0o755)
    try:
        (tmp_path / "a").chmod(0o600)  # not even its owner may pass
        assert pgstack.blocking_ancestor(tmp_path / "a" / "b" / "data", me, set()) == tmp_path / "a"
    finally:
        (tmp_path / "a").chmod(0o700)


def test_socket_dir_is_inside_the_data_dir():
    assert pgstack.socket_dir(Path("/var/lib/hybridflow/postgres/data")) == Path(
        "/var/lib/hybridflow/postgres/data/run")


def test_required_binaries_are_debians_versioned_paths():
    assert pgstack.APT_PACKAGES == [f"postgresql-{pgstack.PG_VERSION}", f"postgresql-client-{pgstack.PG_VERSION}"]
    for binary in ("initdb", "postgres", "pg_ctl", "psql", "pg_isready"):
        assert f"/usr/lib/postgresql/{pgstack.PG_VERSION}/bin/{binary}" in pgstack.REQUIRED_BINARIES
