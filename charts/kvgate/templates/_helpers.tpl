{{/*
Names and labels. Object names do not derive from the release name: the operator's flags, the
NetworkPolicies and the ServiceMonitors find things by these fixed names and by the labels the
operator puts on what it creates (kvgate/operator/naming.py). A second release that would
create the same cluster-scoped or per-namespace objects fails at install instead of
silently sharing them.
*/}}

{{- define "kvgate.operator.name" -}}
{{- .Values.operator.name -}}
{{- end -}}

{{- define "kvgate.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default .Values.operator.name -}}
{{- end -}}

{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object the chart creates. */}}
{{- define "kvgate.labels" -}}
helm.sh/chart: {{ include "kvgate.chart" . }}
app.kubernetes.io/name: kvgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvgate
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The operator pod's selector; never change it (Deployment selectors are immutable). */}}
{{- define "kvgate.operator.selectorLabels" -}}
app.kubernetes.io/name: kvgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvgate.operator.labels" -}}
{{ include "kvgate.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The gateway pods' selector; never change it (StatefulSet selectors are immutable). */}}
{{- define "kvgate.gateway.selectorLabels" -}}
app.kubernetes.io/name: kvgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "kvgate.gateway.labels" -}}
{{ include "kvgate.labels" . }}
app.kubernetes.io/component: gateway
{{- end -}}

{{/*
Labels the operator sets on the pods it creates (naming.py: LABEL_NAME, LABEL_COMPONENT,
LABEL_MANAGED_BY with APP_NAME, COMPONENT_* and MANAGED_BY). Argument: the component.
*/}}
{{- define "kvgate.poolPodSelector" -}}
app.kubernetes.io/name: kvgate
app.kubernetes.io/managed-by: kvgate-operator
app.kubernetes.io/component: {{ . }}
{{- end -}}

{{/* An image reference: registry/repository, then @digest or :tag (default appVersion). */}}
{{- define "kvgate.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- $repository := $image.repository -}}
{{- with $root.Values.images.registry -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository -}}
{{- end -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository ($image.tag | default $root.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/*
The namespaces the operator watches, as a JSON list (empty with allNamespaces): the listed ones,
or the release namespace when none is listed.
*/}}
{{- define "kvgate.watchNamespaces" -}}
{{- if .Values.operator.watch.allNamespaces -}}
{{- list | toJson -}}
{{- else if .Values.operator.watch.namespaces -}}
{{- .Values.operator.watch.namespaces | uniq | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/* Where the NetworkPolicies go, as a JSON list. */}}
{{- define "kvgate.networkPolicyNamespaces" -}}
{{- if .Values.networkPolicy.namespaces -}}
{{- .Values.networkPolicy.namespaces | uniq | toJson -}}
{{- else if .Values.operator.watch.allNamespaces -}}
{{- fail "networkPolicy.namespaces: list the namespaces of your pools (the operator watches all namespaces, so the chart cannot know them)" -}}
{{- else -}}
{{- include "kvgate.watchNamespaces" . -}}
{{- end -}}
{{- end -}}

{{/* The namespace of the example pool. */}}
{{- define "kvgate.examplePool.namespace" -}}
{{- if .Values.examplePool.namespace -}}
{{- .Values.examplePool.namespace -}}
{{- else -}}
{{- $watched := include "kvgate.watchNamespaces" . | fromJsonArray -}}
{{- if $watched }}{{ first $watched }}{{ else }}{{ .Release.Namespace }}{{ end -}}
{{- end -}}
{{- end -}}

{{/*
The operator's permissions: exactly tests/operator/rbac.py REQUIRED_RULES (tests/chart compares
them), less the peering kinds the operator does not use: kopf uses KopfPeering objects in each
watched namespace, or one ClusterKopfPeering with --all-namespaces, and none when standalone.
Argument: a dict with "clusterwide" and "peering" (bools).
*/}}
{{- define "kvgate.operator.rules" -}}
- apiGroups: ["kvgate.dev"]
  resources: ["executorpools"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvgate.dev"]
  resources: ["executorpools/status"]
  verbs: ["patch"]
- apiGroups: ["kvgate.dev"]
  resources: ["executorpools/scale"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if and .peering .clusterwide }}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- else if .peering }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end -}}
