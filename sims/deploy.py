"""A deployment whose strangers stay out: TLS, registered SuperNodes, and the Control API kept
to the operator.

    qpriv-deploy init DEPLOY --nodes 2 --public 10.0.0.5:9092     # certificates, node keys, gateway
    # then, in the order it prints: the SuperLink, the gateway, `flwr supernode register` per
    # node, the SuperNodes, and `flwr run SIM deploy --stream`

Flower (1.42) serves its Runtime, Control and Fleet APIs on one HTTP port (`--host`/`--port`;
`--control-api-address` and `--fleet-api-address` are deprecated and ignored), and its Control
API authenticates accounts only through OIDC, which this distribution lacks. So whoever reaches
that port can register a SuperNode key and start a run, which every node then executes.
The recipe here:

- the SuperLink listens on loopback only, with TLS and `--enable-supernode-auth` (only keys
  registered through the Control API may join); the operator uses the Control API there;
- an nginx gateway on the public address (TLS, the same CA) forwards `/v1/fleet/` alone to the
  SuperLink and answers everything else 403, so a SuperNode joins through it and a stranger
  who reaches it can neither register a key nor start a run;
- each SuperNode holds its own EC key (`--auth-supernode-private-key`) and trusts only the
  deployment's CA.

`init` writes the CA and the SuperLink's certificate (valid for localhost, 127.0.0.1 and the
public host), one OpenSSH EC key pair per node, the gateway's nginx config and the `flwr`
connection for the operator; `commands` gives each process's command line. Tested on loopback
in tests/sims/test_deploy.py and tests/sims/test_deploy_restarts.py.
"""

import argparse
import datetime
import ipaddress
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# What the gateway lets through from the network: the Fleet API, which SuperNodes speak.
FLEET_PATH = "/v1/fleet/"
CONNECTION = "deploy"
VALID_DAYS = 365


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def _certificate(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey,
                 signer: ec.EllipticCurvePrivateKey, extension: x509.ExtensionType, critical: bool,
                 days: int) -> x509.Certificate:
    """`key`'s certificate for `subject`, signed by `signer` for `issuer`, valid from a few
    minutes ago (clocks differ) for `days`."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(extension, critical=critical)
        .sign(signer, hashes.SHA256())
    )


def certificate_authority(common_name: str, days: int = VALID_DAYS) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    name = _name(common_name)
    return key, _certificate(name, name, key, key, x509.BasicConstraints(ca=True, path_length=0), True, days)


def server_certificate(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, hosts: list[str],
                       days: int = VALID_DAYS) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A server's certificate (the SuperLink, the gateway, Ray), valid for every one of `hosts`."""
    key = ec.generate_private_key(ec.SECP384R1())
    names = x509.SubjectAlternativeName([_san(host) for host in dict.fromkeys(hosts)])
    return key, _certificate(_name(hosts[0]), ca.subject, key, ca_key, names, False, days)


def node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """An EC key pair for one SuperNode, in the OpenSSH format Flower reads: (private, public)."""
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / f"{name}.key", folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return private, public


def ray_tls_environment(folder: Path, hosts: list[str]) -> dict[str, str]:
    """Ray's mutual TLS for a simulation's local Ray, as its environment variables: a CA and one
    certificate for `hosts` (what Ray dials: loopback and this machine's node address) in
    `folder` (private; kept while `hosts` stay the same, so every run of one SuperLink uses the
    same pair). Ray's servers listen on every interface, and Flower passes Ray no bind address
    (its Ray init args are num_cpus, num_gpus, logging_level and log_to_driver), so this is what
    keeps strangers off them: without a certificate from this CA, a connection is refused."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    ca_file, certificate_file, key_file = folder / "ca.crt", folder / "ray.crt", folder / "ray.key"
    wanted = [_san(host) for host in dict.fromkeys(hosts)]
    current = None
    if certificate_file.exists() and key_file.exists() and ca_file.exists():
        current = x509.load_pem_x509_certificate(certificate_file.read_bytes())
    if current is None or set(current.extensions.get_extension_for_class(x509.SubjectAlternativeName).value) != set(wanted):
        ca_key, ca = certificate_authority("qpriv simulation Ray CA")
        key, certificate = server_certificate(ca_key, ca, hosts)
        key_file.touch(mode=0o600)
        key_file.write_bytes(_pem(key))
        certificate_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(certificate_file), "RAY_TLS_SERVER_KEY": str(key_file),
            "RAY_TLS_CA_CERT": str(ca_file)}


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Deployment:
    """A deployment folder `init` wrote: where everything is and which addresses it uses."""

    folder: Path
    nodes: int
    # The SuperLink's own port, on loopback only; the gateway's HOST:PORT, where SuperNodes connect.
    superlink_port: int
    public: str

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def certificate(self) -> Path:
        return self.folder / "server.pem"

    @property
    def key(self) -> Path:
        return self.folder / "server.key"

    @property
    def gateway_config(self) -> Path:
        return self.folder / "gateway.conf"

    @property
    def superlink(self) -> str:
        return f"127.0.0.1:{self.superlink_port}"

    def node_key(self, partition: int) -> tuple[Path, Path]:
        return self.folder / f"node{partition}.key", self.folder / f"node{partition}.pub"

    def superlink_command(self, database: Path | None = None) -> list[str]:
        return ["flower-superlink", "--ssl-ca-certfile", str(self.ca), "--ssl-certfile", str(self.certificate),
                "--ssl-keyfile", str(self.key), "--enable-supernode-auth",
                "--database", str(database or self.folder / "superlink.db"),
                "--host", "127.0.0.1", "--port", str(self.superlink_port)]

    def gateway_command(self) -> list[str]:
        return ["nginx", "-c", str(self.gateway_config)]

    def supernode_command(self, partition: int, port: int, state_dir: Path | None = None) -> list[str]:
        """SuperNode `partition` joining through the gateway, with its key, trusting the CA only;
        `port` is its own Runtime API port (on loopback)."""
        node_config = f"partition-id={partition} num-partitions={self.nodes}"
        if state_dir is not None:
            node_config += f' state-dir="{state_dir}"'
        return ["flower-supernode", "--root-certificates", str(self.ca), "--superlink", self.public,
                "--auth-supernode-private-key", str(self.node_key(partition)[0]), "--port", str(port),
                "--node-config", node_config]

    def connection(self, name: str = CONNECTION, address: str | None = None) -> str:
        """The operator's `flwr` connection ($FLWR_HOME/config.toml): the SuperLink on loopback."""
        return f'[superlink.{name}]\naddress = "{address or self.superlink}"\nroot-certificates = "{self.ca}"\n'


def gateway_config(deployment: Deployment) -> str:
    """nginx: TLS on the public address; `/v1/fleet/` to the SuperLink, verified against the CA;
    anything else (the Control and Runtime APIs) 403."""
    folder = deployment.folder
    host, port = _split(deployment.public)
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    temp = folder / "gateway-tmp"
    return f"""# Written by `qpriv-deploy init` (sims/deploy.py): only the Fleet API reaches the SuperLink.
worker_processes 1;
daemon off;
pid {folder / "gateway.pid"};
error_log {folder / "gateway-error.log"};
events {{ worker_connections 512; }}
http {{
    access_log {folder / "gateway-access.log"};
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    server {{
        listen {listen} ssl;
        ssl_certificate {deployment.certificate};
        ssl_certificate_key {deployment.key};
        client_max_body_size 0;
        location {FLEET_PATH} {{
            proxy_pass https://{deployment.superlink};
            proxy_ssl_trusted_certificate {deployment.ca};
            proxy_ssl_verify on;
            proxy_ssl_name localhost;
            proxy_http_version 1.1;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
        }}
        location / {{ return 403; }}
    }}
}}
"""


def init(folder: str | Path, nodes: int, public: str, superlink_port: int = 9091) -> Deployment:
    """Write a deployment's certificates, node keys, gateway config and operator connection."""
    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: at least 1")
    host, _ = _split(public)
    folder = Path(folder).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gateway-tmp").mkdir(exist_ok=True)
    deployment = Deployment(folder, nodes, superlink_port, public)
    ca_key, ca = certificate_authority("qpriv deployment CA")
    key, certificate = server_certificate(ca_key, ca, ["localhost", "127.0.0.1", host])
    deployment.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "ca.key").write_bytes(_pem(ca_key))
    deployment.certificate.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    deployment.key.write_bytes(_pem(key))
    for path in (folder / "ca.key", deployment.key):
        path.chmod(0o600)
    for partition in range(nodes):
        node_key(folder, f"node{partition}")
    deployment.gateway_config.write_text(gateway_config(deployment))
    (folder / "flwr-connection.toml").write_text(deployment.connection())
    return deployment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qpriv-deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("init", help="write certificates, node keys and the gateway config; print the commands")
    command.add_argument("folder")
    command.add_argument("--nodes", type=int, required=True, help="SuperNodes (one key each)")
    command.add_argument("--public", required=True, metavar="HOST:PORT",
                         help="where SuperNodes reach the gateway (the only address open to the network)")
    command.add_argument("--superlink-port", type=int, default=9091, help="the SuperLink's port, on loopback")
    args = parser.parse_args(argv)
    try:
        deployment = init(args.folder, args.nodes, args.public, args.superlink_port)
    except ValueError as error:
        print(f"qpriv-deploy: {error}", file=sys.stderr)
        return 2
    show = shlex.join
    print(f"# 1. the SuperLink (loopback only):\n{show(deployment.superlink_command())}")
    print(f"# 2. the gateway on {deployment.public} (nginx; Fleet API only):\n{show(deployment.gateway_command())}")
    print(f"# 3. the operator's connection: append {deployment.folder / 'flwr-connection.toml'} to "
          "$FLWR_HOME/config.toml (default ~/.flwr), then register each node's key:")
    for partition in range(deployment.nodes):
        print(f"flwr supernode register {deployment.node_key(partition)[1]} {CONNECTION}")
    print("# 4. each SuperNode on its machine (with its own key file and ca.crt):")
    for partition in range(deployment.nodes):
        print(show(deployment.supernode_command(partition, 9094 + partition)))
    print(f"# 5. a run: flwr run sims/usl_easyvqa {CONNECTION} --stream")
    return 0


if __name__ == "__main__":
    sys.exit(main())
