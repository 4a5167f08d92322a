{{/* Names, labels and shared env for the Hermit chart. */}}

{{- define "hermit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hermit.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "hermit.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "hermit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hermit
{{- end -}}

{{/* hermit.selectorLabels: call with (dict "ctx" $ "component" "operator"). */}}
{{- define "hermit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hermit.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "hermit.operator.fullname" -}}
{{- printf "%s-operator" (include "hermit.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hermit.nodeAgent.fullname" -}}
{{- printf "%s-node-agent" (include "hermit.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Secret with the sealing keys: the user's, or the one the chart generates. */}}
{{- define "hermit.sealingSecretName" -}}
{{- .Values.nodeAgent.sealing.existingSecret | default (printf "%s-sealing" (include "hermit.fullname" .) | trunc 63 | trimSuffix "-") -}}
{{- end -}}

{{- define "hermit.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "hermit.operator.fullname" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "hermit.nodeAgent.serviceAccountName" -}}
{{- if .Values.nodeAgent.serviceAccount.create -}}
{{- default (include "hermit.nodeAgent.fullname" .) .Values.nodeAgent.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.nodeAgent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* hermit.image: call with (dict "ctx" $ "image" .Values.operator.image). */}}
{{/* An image reference: [global.imageRegistry/]repository, then @digest when set (the tag
     is then ignored), else :tag (the chart's appVersion when empty). */}}
{{- define "hermit.image" -}}
{{- $repo := .image.repository -}}
{{- with .ctx.Values.global.imageRegistry }}{{ $repo = printf "%s/%s" (trimSuffix "/" .) $repo }}{{ end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repo .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Environment both components share: the checkpoint store (HERMIT_S3_*, see
     hermit_common.settings.StoreSettings), the cloud provider and metrics. */}}
{{- define "hermit.commonEnv" -}}
- name: HERMIT_S3_BUCKET
  value: {{ required "s3.bucket is required: the S3 bucket that stores checkpoints" .Values.s3.bucket | quote }}
- name: HERMIT_S3_PREFIX
  value: {{ .Values.s3.prefix | quote }}
- name: HERMIT_S3_REGION
  value: {{ .Values.s3.region | quote }}
{{- with .Values.s3.endpoint }}
- name: HERMIT_S3_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: HERMIT_CLOUD_PROVIDER
  value: {{ .Values.cloudProvider | quote }}
- name: HERMIT_METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
- name: HERMIT_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: HERMIT_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end -}}

{{/* hermit.s3CredentialsEnv: the bucket-wide credential (s3.existingSecret): the
     operator's always, the node-agents' only without scoped store credentials. */}}
{{- define "hermit.s3CredentialsEnv" -}}
{{- with .Values.s3.existingSecret }}
- name: HERMIT_S3_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.s3.accessKeyIdKey }}
- name: HERMIT_S3_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.s3.secretAccessKeyKey }}
{{- end }}
{{- end -}}

{{/* Scoped store credentials (docs/storage.md#scoped-store-credentials): with the key
service, unless s3.sharedNodeCredentials falls back to the shared credential. */}}
{{- define "hermit.scopedStore.enabled" -}}
{{- if and (include "hermit.keyService.enabled" .) (not .Values.s3.sharedNodeCredentials) -}}true{{- end -}}
{{- end -}}

{{/* hermit.s3Port: the TCP port of s3.endpoint (443 for https and for AWS S3 itself,
     80 for http without a port). */}}
{{- define "hermit.s3Port" -}}
{{- include "hermit.urlPort" (default "https://s3.amazonaws.com" .Values.s3.endpoint) -}}
{{- end -}}

{{/* hermit.urlPort: the TCP port of a URL (443 for https, 80 for http without a port). */}}
{{- define "hermit.urlPort" -}}
{{- $url := urlParse . -}}
{{- $port := regexFind ":[0-9]+$" $url.host | trimPrefix ":" -}}
{{- if $port -}}
{{- $port -}}
{{- else if eq $url.scheme "http" -}}
80
{{- else -}}
443
{{- end -}}
{{- end -}}

{{/* The key service (docs/security.md#the-key-service): on when sealing is, the value
asks for it, and both components are installed. */}}
{{- define "hermit.keyService.enabled" -}}
{{- $s := .Values.nodeAgent.sealing -}}
{{- if and .Values.operator.enabled .Values.nodeAgent.enabled $s.enabled $s.keyService.enabled -}}true{{- end -}}
{{- end -}}

{{- define "hermit.keyService.name" -}}
{{- printf "%s-keys" (include "hermit.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The key service's serving certificate (operator only) and its CA alone (node-agents):
     made by the ensure-secrets hook Job, not rendered. Not the names the chart's earlier
     `lookup` templates used: an upgrade deletes those, after the hook ran. */}}
{{- define "hermit.keyService.servingSecret" -}}
{{- printf "%s-keys-serving" (include "hermit.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hermit.keyService.trustSecret" -}}
{{- printf "%s-keys-trust" (include "hermit.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The sealing Secret is the chart's to create (by the hook Job) unless it is the user's. */}}
{{- define "hermit.sealing.generated" -}}
{{- $s := .Values.nodeAgent.sealing -}}
{{- if and .Values.nodeAgent.enabled $s.enabled (not $s.existingSecret) (not (include "hermit.sealing.kms" .)) -}}true{{- end -}}
{{- end -}}

{{/* AWS KMS holds the KEK (docs/security.md#a-cloud-kms): only through the key service. */}}
{{- define "hermit.sealing.kms" -}}
{{- $s := .Values.nodeAgent.sealing -}}
{{- if and $s.enabled $s.kms.keyId -}}
{{- if not (include "hermit.keyService.enabled" .) -}}
{{- fail "nodeAgent.sealing.kms.keyId needs the key service (nodeAgent.sealing.keyService.enabled, with operator.enabled and nodeAgent.enabled): node-agents do not call KMS (docs/security.md#a-cloud-kms)" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* hermit.notSpot: matchExpressions that exclude every provider's spot nodes (the labels
     hermit_operator.podspec knows: Karpenter, EKS, GKE spot and provisioning, AKS). */}}
{{- define "hermit.notSpot" -}}
- {key: karpenter.sh/capacity-type, operator: NotIn, values: [spot]}
- {key: eks.amazonaws.com/capacityType, operator: NotIn, values: [SPOT]}
- {key: cloud.google.com/gke-spot, operator: NotIn, values: ["true"]}
- {key: cloud.google.com/gke-provisioning, operator: NotIn, values: [spot]}
- {key: kubernetes.azure.com/scalesetpriority, operator: NotIn, values: [spot]}
{{- end }}

{{/* Where operator pods run (the Deployment and the ensure-secrets hook Job). */}}
{{- define "hermit.operator.placement" -}}
{{- with .Values.operator.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.operator.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.operator.affinity }}
affinity:
  {{- toYaml .Values.operator.affinity | nindent 2 }}
{{- else if .Values.operator.avoidSpot }}
# Off spot nodes: the operator moves the sandboxes a spot reclaim hits, so it must
# not be hit with them (every provider's spot label; NotIn also takes unlabelled
# nodes). operator.affinity replaces this; operator.avoidSpot=false drops it.
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            {{- include "hermit.notSpot" . | nindent 12 }}
{{- end }}
{{- end -}}

{{/* crds.enabled and crds.keep, "true" or "false"; true when absent: `helm upgrade
     --reuse-values` from a release of a chart without them keeps that chart's values. */}}
{{- define "hermit.crds.enabled" -}}
{{- $crds := .Values.crds | default dict -}}
{{- ternary "true" "false" (or (not (hasKey $crds "enabled")) (eq $crds.enabled true)) -}}
{{- end -}}

{{- define "hermit.crds.keep" -}}
{{- $crds := .Values.crds | default dict -}}
{{- ternary "true" "false" (or (not (hasKey $crds "keep")) (eq $crds.keep true)) -}}
{{- end -}}

{{/* The SIG Sandbox pod webhook (docs/agent-sandbox.md#opting-a-sandbox-in): served by
     the operator, opt-in. */}}
{{- define "hermit.sigWebhook.enabled" -}}
{{- if and .Values.operator.enabled .Values.agentSandbox.webhook.enabled -}}true{{- end -}}
{{- end -}}

{{- define "hermit.sigWebhook.name" -}}
{{- printf "%s-sig-webhook" (include "hermit.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Its serving certificate (tls.crt, tls.key and ca.crt): made by the ensure-secrets hook
     Job, or by cert-manager with agentSandbox.webhook.certManager.enabled. */}}
{{- define "hermit.sigWebhook.servingSecret" -}}
{{- printf "%s-sig-webhook-serving" (include "hermit.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hermit.sigWebhook.generated" -}}
{{- if and (include "hermit.sigWebhook.enabled" .) (not .Values.agentSandbox.webhook.certManager.enabled) -}}true{{- end -}}
{{- end -}}
