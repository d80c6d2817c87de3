"""x509 certificates for TLS migrations, made with Debian's certtool
(gnutls-bin): `qmig certs DIR` (make_set) and the tests, which make theirs
at test time (never checked in). Directories are laid out as QEMU's
tls-creds-x509 wants them."""
import os
import re
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

    organization = "qmigd tests"

    def __init__(self, root, name="qmigd test CA", days=3, subdir=True):
        self.dir = os.path.join(root, name.replace(" ", "-")) if subdir else root
        self.days = days
        os.makedirs(self.dir, exist_ok=True)
        self.key = os.path.join(self.dir, "ca-key.pem")
        self.cert = os.path.join(self.dir, "ca-cert.pem")
        _key(self.key)
        _certtool("--generate-self-signed", "--load-privkey", self.key, "--outfile", self.cert,
                  template=f'cn = "{name}"\nca\ncert_signing_key\nexpiration_days = {days}\n')

    def issue(self, out_dir, role, cn, dns=("localhost",), ips=("127.0.0.1",), dates=None,
              units=()):
        """Writes ca-cert.pem and ROLE-cert.pem / ROLE-key.pem into out_dir
        (role: server or client). dates: (activation, expiration) strings;
        units: organizational units, each an OU of the subject."""
        os.makedirs(out_dir, exist_ok=True)
        if os.path.realpath(out_dir) != os.path.realpath(self.dir):
            shutil.copy(self.cert, os.path.join(out_dir, "ca-cert.pem"))
        key = os.path.join(out_dir, f"{role}-key.pem")
        cert = os.path.join(out_dir, f"{role}-cert.pem")
        _key(key)
        t = f'organization = "{self.organization}"\ncn = "{cn}"\nsigning_key\nencryption_key\n'
        t += "".join(f'unit = "{u}"\n' for u in units)
        t += "tls_www_server\n" if role == "server" else "tls_www_client\n"
        t += "".join(f'dns_name = "{d}"\n' for d in dns)
        t += "".join(f'ip_address = "{i}"\n' for i in ips)
        if dates:
            t += f'activation_date = "{dates[0]}"\nexpiration_date = "{dates[1]}"\n'
        else:
            t += f"expiration_days = {self.days}\n"
        _certtool("--generate-certificate", "--load-privkey", key, "--load-ca-certificate",
                  self.cert, "--load-ca-privkey", self.key, "--outfile", cert, template=t)
        return out_dir


def client_dn(cn):
    """The DN gnutls_x509_crt_get_dn() reports for a certificate issue()
    made, which is what QEMU's and qmigd's authz-list rules match."""
    return f"O=qmigd tests,CN={cn}"


def unfit_name(name):
    """Why `name` cannot go into a certtool template as a certificate's
    name, or None: a template value is a quoted string with no escapes, so
    a '"' would end it early (a name cut short) and a line end would start
    a new field."""
    if not name:
        return "empty"
    bad = [c for c in name if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7f]
    return f"holds {bad[0]!r}, which a certtool template cannot carry" if bad else None


def subject_dn(cert_dir, role):
    """The subject DN of ROLE-cert.pem in cert_dir as authz-list rules match
    it: gnutls_x509_crt_get_dn2()'s order, which is the reverse of the
    RFC 4514 order certtool -i prints, each value keeping its escapes (a
    comma in a name is "\\,")."""
    out = subprocess.run(["certtool", "-i", "--infile", os.path.join(cert_dir, f"{role}-cert.pem")],
                         check=True, capture_output=True, text=True).stdout
    rfc4514 = next(l.split("Subject: ", 1)[1] for l in out.splitlines() if "Subject: " in l)
    return ",".join(reversed(re.split(r"(?<!\\),", rfc4514)))


def make_set(out_dir, dns, ips, client_cn, days):
    """One directory both ends can use (copy it to each host): a new CA's
    ca-cert.pem (its ca-key.pem too, 0600: it signs new certificates, keep
    it off the hosts), server-cert.pem/server-key.pem for the destination
    carrying the names and addresses the source will dial, and
    client-cert.pem/client-key.pem for the source (what verify-peer and an
    authz-list check). Returns the client's DN as authz-list rules match it."""
    ca = CA(out_dir, "qmigd CA", days=days, subdir=False)
    ca.organization = "qmigd"
    ca.issue(out_dir, "server", dns[0] if dns else ips[0], dns=dns, ips=ips)
    ca.issue(out_dir, "client", client_cn, dns=(), ips=())
    return subject_dn(out_dir, "client")
