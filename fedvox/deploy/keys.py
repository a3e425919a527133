"""Key material of a deployed federation: a CA, the SuperLink's TLS certificate, node key pairs.

Runtime-free (the `cryptography` package only). Written once by `fedvox deploy keys`; the
SuperLink serves the certificate, SuperNodes trust the CA and sign with their EC keys.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedvox.atomic import atomic_write_bytes
from fedvox.errors import ConfigError, FedvoxError

CURVE = ec.SECP384R1()  # P-384: a NIST curve, as Flower's node authentication requires
VALID_DAYS = 365
PRIVATE = 0o600


@dataclass(frozen=True)
class KeyLayout:
    """Where `fedvox deploy keys OUT` puts each file (the other commands read the same names)."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "superlink.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "superlink.key"

    def node_key(self, i: int) -> Path:
        """Node i's private key (OpenSSH format, 0600)."""
        return self.root / "nodes" / f"node-{i}.key"

    def node_pub(self, i: int) -> Path:
        """Node i's public key (OpenSSH format): what the SuperLink registers."""
        return self.root / "nodes" / f"node-{i}.pub"

    def nodes(self) -> list[int]:
        """The node numbers whose key pairs exist, sorted."""
        return sorted(int(p.stem.split("-")[1]) for p in self.root.glob("nodes/node-*.pub"))

    def check(self, nodes: int = 0) -> None:
        """Refuse a folder without the CA, the server certificate or `nodes` node keys."""
        want = [self.ca_cert, self.server_cert, self.server_key]
        want += [p for i in range(nodes) for p in (self.node_key(i), self.node_pub(i))]
        missing = [str(p) for p in want if not p.is_file()]
        if missing:
            raise FedvoxError(
                f"{self.root}: missing key files {missing}. Fix: run "
                f"`fedvox deploy keys {self.root} --nodes {max(nodes, 1)}` first"
            )


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    """DNS names and IP addresses, each as the kind of name it is."""
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            if not h or any(c.isspace() for c in h):
                raise ConfigError("--host", f"{h!r} is neither a host name nor an IP") from None
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_ca(now: datetime.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA that signs only the SuperLink's certificate."""
    key = ec.generate_private_key(CURVE)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("fedvox federation CA"))
        .issuer_name(_name("fedvox federation CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA384())
    )
    return key, cert


def make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    hosts: list[str],
    now: datetime.datetime,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The SuperLink's TLS key and certificate, valid for `hosts` (names and IPs)."""
    if not hosts:
        raise ConfigError("--host", "no host name or IP for the SuperLink's certificate")
    key = ec.generate_private_key(CURVE)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    return key, cert


def node_key_pair() -> tuple[bytes, bytes]:
    """One node's EC key pair as (private, public), both in OpenSSH format."""
    key = ec.generate_private_key(CURVE)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public + b"\n"


def write_keys(out: Path, hosts: list[str], nodes: int, overwrite: bool = False) -> KeyLayout:
    """A CA, the SuperLink's certificate for `hosts` and `nodes` node key pairs under `out`;
    each file written atomically, private keys 0600. Refuses to replace existing keys."""
    if nodes < 0:
        raise ConfigError("--nodes", f"{nodes} node key pairs", "give 0 or more")
    layout = KeyLayout(Path(out))
    if not overwrite and layout.ca_key.exists():
        raise FedvoxError(
            f"{layout.ca_key} exists: keys were already made there. Fix: choose another folder, "
            "or pass --overwrite (nodes registered with the old keys must be registered again)"
        )
    now = datetime.datetime.now(datetime.UTC)
    ca_key, ca_cert = make_ca(now)
    key, cert = make_server_cert(ca_key, ca_cert, hosts, now)
    atomic_write_bytes(layout.ca_key, _key_pem(ca_key), PRIVATE)
    atomic_write_bytes(layout.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(layout.server_key, _key_pem(key), PRIVATE)
    atomic_write_bytes(layout.server_cert, cert.public_bytes(serialization.Encoding.PEM))
    for i in range(nodes):
        private, public = node_key_pair()
        atomic_write_bytes(layout.node_key(i), private, PRIVATE)
        atomic_write_bytes(layout.node_pub(i), public)
    return layout
