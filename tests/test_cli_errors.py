"""``kvhandoff serve`` refuses a bad model path, catalog, adapter, certificate, key or KV
events setting, or a server beyond loopback with neither a key nor mutual TLS, as one
line naming it (or the flag to add), exit code 2, no traceback, and starts nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = __file__


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags,says", [
    (["--role", "decode", "--catalog", "shop"], "--catalog wants NAME=PATH, not 'shop'"),
    (["--role", "decode", "--catalog", "shop=/no/such/file"], "/no/such/file"),
    (["--role", "decode", "--model", "/no/such/model"], "not a model directory"),
    (["--role", "prefill", "--adapter", "a=/no/such/adapter"], "adapter 'a'"),
    (["--role", "prefill", "--tls-cert", "/no/cert.pem", "--tls-key", "/no/key.pem"],
     "/no/cert.pem"),
    (["--role", "router", "--prefill", "127.0.0.1:1", "--api-key", "k", "--operator-key", "k"],
     "operator key must differ"),
    # KV events off loopback without a key; a key file that is not there.
    (["--role", "decode", "--kv-events", "10.213.7.1"], "--kv-events-key"),
    (["--role", "decode", "--kv-events-key", "/no/such/key"], "/no/such/key"),
    (["--role", "router", "--prefill", "127.0.0.1:1", "--kv-events-key", "/no/such/key"],
     "/no/such/key"),
    # Beyond loopback without a guard: the flag to add (kvhandoff.keys.check_exposure).
    (["--role", "prefill", "--host", "0.0.0.0"], "add --engine-key-file PATH"),
    (["--role", "decode", "--host", "10.213.7.1"], "add --engine-key-file PATH"),
    (["--role", "router", "--prefill", "127.0.0.1:1", "--host", "0.0.0.0"], "add --api-key"),
    # An operator key alone leaves the router's requests open.
    (["--role", "router", "--prefill", "127.0.0.1:1", "--host", "0.0.0.0",
      "--operator-key", "o" * 20], "add --api-key"),
    # Past that check with a key or --insecure: the next bad flag is what is refused.
    (["--role", "prefill", "--host", "0.0.0.0", "--insecure", "--model", "/no/such/model"],
     "not a model directory"),
    (["--role", "router", "--prefill", "127.0.0.1:1", "--host", "0.0.0.0", "--api-key",
      "c" * 20, "--kv-events-key", "/no/such/key"], "/no/such/key"),
    # Mutual TLS counts as the guard (a client CA); TLS alone does not. (server_tls only
    # checks that the files exist: this file stands in for each PEM.)
    (["--role", "prefill", "--host", "0.0.0.0", "--tls-cert", HERE, "--tls-key", HERE,
      "--tls-client-ca", HERE, "--model", "/no/such/model"], "not a model directory"),
    (["--role", "prefill", "--host", "0.0.0.0", "--tls-cert", HERE, "--tls-key", HERE],
     "add --engine-key-file PATH"),
    # A bad engine key; the NIXL side channel on every interface.
    (["--role", "prefill", "--engine-key-file", "/no/such/engine.key"], "/no/such/engine.key"),
    (["--role", "prefill", "--side-channel-host", "0.0.0.0"], "--side-channel-host"),
])
def test_a_bad_flag_is_one_line_and_exit_2(flags, says) -> None:
    # No engine key from this environment (the exposure cases are about flags alone).
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVHANDOFF_ENGINE_KEY", "KVHANDOFF_ENGINE_KEY_FILE")}
    done = subprocess.run([sys.executable, "-m", "cli.main", "serve", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=240, env=env)
    err = [line for line in done.stderr.splitlines() if "Triton" not in line]
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(err) == 1, done.stderr[-2000:]
    assert says in err[0] and err[0].startswith("kvhandoff serve: "), err
