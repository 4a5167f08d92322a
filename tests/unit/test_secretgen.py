"""The generated Secrets' contents (operator/hermit_operator/secretgen.py)."""

from __future__ import annotations

import base64
import datetime
import ssl
import tempfile
from pathlib import Path

from cryptography import x509

from hermit_common.seal import Keyring
from hermit_operator import secretgen


def test_a_new_keyring_has_one_random_current_kek() -> None:
    a, b = secretgen.new_sealing_keys(), secretgen.new_sealing_keys()
    assert a["current"] == b"1" and a["1"] != b["1"]
    assert len(base64.b64decode(a["1"], validate=True)) == 32
    # What the operator reads from the mounted Secret's files.
    with tempfile.TemporaryDirectory() as d:
        for name, value in a.items():
            Path(d, name).write_bytes(value)
        ring = Keyring.from_dir(Path(d))
        assert ring.current == "1" and ring.keys["1"] == base64.b64decode(a["1"])


def test_the_serving_certificate_verifies_for_the_service_names_under_its_ca() -> None:
    names = secretgen.service_dns_names("hermit-keys", "hermit-system")
    now = datetime.datetime(2026, 12, 2, tzinfo=datetime.UTC)
    tls = secretgen.new_serving_tls("hermit-keys-ca", names, now=now)
    cert = x509.load_pem_x509_certificate(tls["tls.crt"])
    ca = x509.load_pem_x509_certificate(tls["ca.crt"])
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [
        "hermit-keys.hermit-system.svc", "hermit-keys.hermit-system",
        "hermit-keys.hermit-system.svc.cluster.local", "hermit-keys"]
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc
    # Usable as is by the key service's TLS server and its clients.
    with tempfile.TemporaryDirectory() as d:
        Path(d, "c").write_bytes(tls["tls.crt"])
        Path(d, "k").write_bytes(tls["tls.key"])
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(f"{d}/c", f"{d}/k")
        ssl.create_default_context(cadata=tls["ca.crt"].decode())
