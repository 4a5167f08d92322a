"""The contents of the Secrets Hermit generates for itself (pure: no Kubernetes here).

`ensure_secrets.py` writes them once, when they are absent; nothing regenerates them.
The chart renders no key, certificate or random byte (no ``lookup``/``randBytes``), so
``helm template`` and GitOps tools render the same manifests every time and never
replace a key that sealed checkpoints depend on (docs/security.md, "Generated Secrets").
"""

from __future__ import annotations

import base64
import datetime
import os
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

KEK_BYTES = 32
FIRST_KEK_ID = "1"
CERT_DAYS = 3650  # as the chart's genCA did: rotation is by deleting the Secrets (docs)


def new_sealing_keys() -> dict[str, bytes]:
    """A keyring with one random KEK, current: the sealing Secret's data, each entry as its
    mounted file reads (a KEK is base64 text, as `openssl rand -base64 32` writes it;
    seal.Keyring)."""
    return {"current": FIRST_KEK_ID.encode(),
            FIRST_KEK_ID: base64.b64encode(os.urandom(KEK_BYTES))}


def service_dns_names(service: str, namespace: str) -> list[str]:
    """The names a Service's serving certificate must hold: what clients dial."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}",
            f"{service}.{namespace}.svc.cluster.local", service]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_serving_tls(ca_name: str, dns_names: Sequence[str], *, days: int = CERT_DAYS,
                    now: datetime.datetime | None = None) -> dict[str, bytes]:
    """A CA of its own and a serving certificate it signed for ``dns_names``: the
    ``kubernetes.io/tls`` Secret's data (``tls.crt``, ``tls.key``, ``ca.crt``)."""
    if not dns_names:
        raise ValueError("a serving certificate needs at least one DNS name")
    start = (now or datetime.datetime.now(datetime.UTC)) - datetime.timedelta(hours=1)
    end = start + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_subject).issuer_name(ca_subject)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True,
            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
        .issuer_name(ca_subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]),
                       critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return {"tls.crt": cert.public_bytes(serialization.Encoding.PEM),
            "tls.key": _pem_key(key),
            "ca.crt": ca_cert.public_bytes(serialization.Encoding.PEM)}
