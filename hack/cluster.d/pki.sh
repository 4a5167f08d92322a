# Certificates (openssl, EC P-256) and kubeconfigs. Sourced by hack/cluster.
# shellcheck shell=bash
PKI="$CLUSTER_DIR/pki"

pki_ca() {
  mkdir -p "$PKI"
  [ -f "$PKI/ca.crt" ] && return 0
  openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$PKI/ca.key" -days 3650 -subj "/CN=hermit-local-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$PKI/ca.crt" 2>/dev/null || die "openssl: creating the cluster CA failed"
  # service-account token signing key pair
  openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
  openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
}

# pki_cert NAME SUBJECT USAGE [SANS]: NAME.crt/.key signed by the CA; USAGE client|server|both.
pki_cert() {
  local name=$1 subj=$2 usage=$3 sans=${4:-}
  [ -f "$PKI/$name.crt" ] && return 0
  local eku=clientAuth ext
  case $usage in server) eku=serverAuth ;; both) eku="serverAuth,clientAuth" ;; esac
  ext=$(mktemp)
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [ -n "$sans" ] && echo "subjectAltName=$sans"
  } >"$ext"
  openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/$name.key" 2>/dev/null
  openssl req -new -key "$PKI/$name.key" -subj "$subj" 2>/dev/null \
    | openssl x509 -req -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -set_serial "0x$(openssl rand -hex 16)" -days 3650 \
      -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null || die "openssl: signing $name failed"
  rm -f "$ext"
}

# kubeconfig_write FILE USER CERTNAME: kubeconfig with the CA and client cert embedded.
kubeconfig_write() {
  local file=$1 user=$2 cert=$3
  local b64="base64 -w0"
  umask 077
  cat >"$file" <<KC
apiVersion: v1
kind: Config
clusters:
- name: hermit-local
  cluster:
    server: $APISERVER_URL
    certificate-authority-data: $($b64 <"$PKI/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $($b64 <"$PKI/$cert.crt")
    client-key-data: $($b64 <"$PKI/$cert.key")
contexts:
- name: hermit-local
  context: {cluster: hermit-local, user: $user}
current-context: hermit-local
KC
  umask 022
}

pki_control_plane() {
  pki_ca
  pki_cert apiserver "/CN=kube-apiserver" server \
    "IP:$BRIDGE_IP,IP:$KUBERNETES_SVC_IP,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  pki_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" client
  pki_cert admin "/O=system:masters/CN=kubernetes-admin" client
  pki_cert controller-manager "/CN=system:kube-controller-manager" client
  pki_cert scheduler "/CN=system:kube-scheduler" client
  pki_cert kube-proxy "/CN=system:kube-proxy" client
  kubeconfig_write "$CLUSTER_DIR/kubeconfig" kubernetes-admin admin
  kubeconfig_write "$CLUSTER_DIR/controller-manager.kubeconfig" system:kube-controller-manager controller-manager
  kubeconfig_write "$CLUSTER_DIR/scheduler.kubeconfig" system:kube-scheduler scheduler
  kubeconfig_write "$CLUSTER_DIR/kube-proxy.kubeconfig" system:kube-proxy kube-proxy
}

# pki_node NAME IP: kubelet client identity system:node:NAME and its serving cert.
pki_node() {
  local name=$1 ip=$2
  pki_cert "node-$name" "/O=system:nodes/CN=system:node:$name" client
  pki_cert "node-$name-serving" "/CN=$name" server "IP:$ip,DNS:$name"
  kubeconfig_write "$CLUSTER_DIR/nodes/$name/kubelet.kubeconfig" "system:node:$name" "node-$name"
}

pki_node_forget() { rm -f "$PKI/node-$1".* "$PKI/node-$1-serving".*; }
