{{- /*
The batch flags of `kvgate gateway` and `kvgate batch-feeder` (kvgate/gateway/batch_flags.py,
one definition for both), from `batches`: the S3 store, its credentials as files from the
Secret, the batch class, the window, the limits and the topics' layout. Both take the same
flags, so the gateway and the feeder agree on every batch setting.
*/ -}}
{{- define "kvgate.batches.args" -}}
{{- $batches := .Values.batches }}
{{- $s3 := $batches.s3 }}
- --batch-store=s3
- --batch-s3-bucket={{ $s3.bucket }}
{{- with $s3.endpoint }}
- --batch-s3-endpoint={{ . }}
{{- end }}
- --batch-s3-prefix={{ $s3.prefix }}
- --batch-s3-region={{ $s3.region }}
{{- if $s3.allowHttp }}
- --batch-s3-allow-http
{{- end }}
{{- if $s3.virtualHostedStyle }}
- --batch-s3-virtual-hosted-style
{{- end }}
{{- if $s3.credentialsSecret.name }}
- --batch-s3-access-key-id-file=/etc/kvgate/s3/access-key-id
- --batch-s3-secret-access-key-file=/etc/kvgate/s3/secret-access-key
{{- end }}
- --batch-priority={{ int $batches.priority }}
- --batch-window={{ int $batches.window }}
- --batch-max-file-bytes={{ int64 $batches.limits.maxFileBytes }}
- --batch-max-file-lines={{ int64 $batches.limits.maxFileLines }}
- --batch-max-line-bytes={{ int64 $batches.limits.maxLineBytes }}
- --batch-partitions={{ int $batches.partitions }}
- --batch-replication-factor={{ int $batches.replicationFactor }}
{{- end }}

{{- define "kvgate.batches.volumeMounts" -}}
{{- if .Values.batches.s3.credentialsSecret.name }}
- name: s3-credentials
  mountPath: /etc/kvgate/s3
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvgate.batches.volumes" -}}
{{- with .Values.batches.s3.credentialsSecret }}
{{- if .name }}
- name: s3-credentials
  secret:
    secretName: {{ .name }}
    items:
      - key: {{ .accessKeyIdKey }}
        path: access-key-id
      - key: {{ .secretAccessKeyKey }}
        path: secret-access-key
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgate.batchFeeder.selectorLabels" -}}
app.kubernetes.io/name: kvgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: batch-feeder
{{- end -}}

{{- define "kvgate.batchFeeder.labels" -}}
{{ include "kvgate.labels" . }}
app.kubernetes.io/component: batch-feeder
{{- end -}}
