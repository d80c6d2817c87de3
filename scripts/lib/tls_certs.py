"""Test certificates for TLS migrations, made with Debian's certtool
(gnutls-bin) at test time: never checked in. Directories are laid out as
QEMU's tls-creds-x509 wants them."""
import os
import shutil
import subprocess
import tempfile



def _certtool(*args, template=None):
    with tempfile.NamedTemporaryFile("w", suffix=".info", delete=False) as t:
        t.write(template or "")
        tpath = t.name
    try:
        subprocess.run(["certtool", *args, "--template", tpath], check=True,
                       capture_output=True)
    finally:
        os.unlink(tpath)


def _key(path):
    # RSA: QEMU requires key encipherment in a certificate's key usage,
    # which an ECDSA key cannot have.
    subprocess.run(["certtool", "--generate-privkey", "--key-type", "rsa", "--bits", "2048",
                    "--outfile", path], check=True, capture_output=True)
    os.chmod(path, 0o600)


class CA:
    """A certificate authority that signs server and client certificates."""

    def __init__(self, root, name="qmigd test CA"):
        self.dir = os.path.join(root, name.replace(" ", "-"))
        os.makedirs(self.dir, exist_ok=True)
        self.key = os.path.join(self.dir, "ca-key.pem")
        self.cert = os.path.join(self.dir, "ca-cert.pem")
        _key(self.key)
        _certtool("--generate-self-signed", "--load-privkey", self.key, "--outfile", self.cert,
                  template=f'cn = "{name}"\nca\ncert_signing_key\nexpiration_days = 3\n')

    def issue(self, out_dir, role, cn, dns=("localhost",), ips=("127.0.0.1",), dates=None,
              units=()):
        """Writes ca-cert.pem and ROLE-cert.pem / ROLE-key.pem into out_dir
        (role: server or client). dates: (activation, expiration) strings;
        units: organizational units, each an OU of the subject."""
        os.makedirs(out_dir, exist_ok=True)
        shutil.copy(self.cert, os.path.join(out_dir, "ca-cert.pem"))
        key = os.path.join(out_dir, f"{role}-key.pem")
        cert = os.path.join(out_dir, f"{role}-cert.pem")
        _key(key)
        t = f'organization = "qmigd tests"\ncn = "{cn}"\nsigning_key\nencryption_key\n'
        t += "".join(f'unit = "{u}"\n' for u in units)
        t += "tls_www_server\n" if role == "server" else "tls_www_client\n"
        t += "".join(f'dns_name = "{d}"\n' for d in dns)
        t += "".join(f'ip_address = "{i}"\n' for i in ips)
        if dates:
            t += f'activation_date = "{dates[0]}"\nexpiration_date = "{dates[1]}"\n'
        else:
            t += "expiration_days = 3\n"
        _certtool("--generate-certificate", "--load-privkey", key, "--load-ca-certificate",
                  self.cert, "--load-ca-privkey", self.key, "--outfile", cert, template=t)
        return out_dir


def client_dn(cn):
    """The DN gnutls_x509_crt_get_dn() reports for a certificate issue()
    made, which is what QEMU's and qmigd's authz-list rules match."""
    return f"O=qmigd tests,CN={cn}"


def subject_dn(cert_dir, role):
    """The subject DN of ROLE-cert.pem in cert_dir as authz-list rules match
    it: gnutls_x509_crt_get_dn2()'s order, which is the reverse of the
    RFC 4514 order certtool -i prints (values here hold no commas)."""
    out = subprocess.run(["certtool", "-i", "--infile", os.path.join(cert_dir, f"{role}-cert.pem")],
                         check=True, capture_output=True, text=True).stdout
    rfc4514 = next(l.split("Subject: ", 1)[1] for l in out.splitlines() if "Subject: " in l)
    return ",".join(reversed(rfc4514.split(",")))
