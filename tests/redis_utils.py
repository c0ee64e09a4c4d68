"""redis-server processes with a password, ACL users or TLS, and test certificates for them.
(A plain server is conftest's ``redis_server``.)"""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis


class RedisProcess:
    """A redis-server of our own (loopback, no persistence) with extra options; ready once
    ``url`` answers a PING. Always ``stop()`` it."""

    def __init__(self, tmp_dir: Path, port: int, url: str, *options: str) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt install redis-server; .ci/run does this)")
        self.port, self.url = port, url
        self.log_path = tmp_dir / "redis-server.log"
        self.proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", str(tmp_dir), "--logfile", str(self.log_path), *options])
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, OSError):
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        log = self.log_path.read_text() if self.log_path.exists() else ""
                        raise RuntimeError(f"redis-server did not start:\n{log[-2000:]}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def make_certificates(out: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, both signed
    by the CA (openssl CLI, EC P-256, valid one day). Returns the file paths by name."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is not installed")
    paths = {name: out / name for name in ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt",
                                           "client.key")}

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=out)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=engine test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (out / f"{name}.ext").write_text(ext + "\n")
        openssl("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt")
    return paths
