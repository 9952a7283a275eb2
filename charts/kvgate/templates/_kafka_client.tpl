{{- /*
A Kafka client's security as the gateway and the batch feeder take it (the `kafka.security`
value shape: `protocol`, `sasl`, `tls`; Secrets mounted as files under /etc/kvgate/kafka-*):
its command-line flags, volume mounts and volumes. Each takes the security value as its context.
*/ -}}
{{- define "kvgate.kafkaClient.args" -}}
- --kafka-security-protocol={{ .protocol | default "PLAINTEXT" }}
{{- with .sasl }}
- --kafka-sasl-mechanism={{ .mechanism }}
- --kafka-sasl-username={{ .username }}
- --kafka-sasl-password-file=/etc/kvgate/kafka-sasl/password
{{- end }}
{{- with .tls }}
- --kafka-ssl-cafile=/etc/kvgate/kafka-tls/ca.crt
{{- if .certificate }}
- --kafka-ssl-certfile=/etc/kvgate/kafka-tls/tls.crt
- --kafka-ssl-keyfile=/etc/kvgate/kafka-tls/tls.key
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgate.kafkaClient.volumeMounts" -}}
{{- if .sasl }}
- name: kafka-sasl
  mountPath: /etc/kvgate/kafka-sasl
  readOnly: true
{{- end }}
{{- if .tls }}
- name: kafka-tls
  mountPath: /etc/kvgate/kafka-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvgate.kafkaClient.volumes" -}}
{{- with .sasl }}
- name: kafka-sasl
  secret:
    secretName: {{ .passwordSecret.name }}
    items:
      - key: {{ .passwordSecret.key }}
        path: password
    defaultMode: 0440
{{- end }}
{{- with .tls }}
- name: kafka-tls
  secret:
    secretName: {{ .secretName }}
    items:
      - key: {{ .ca | default "ca.crt" }}
        path: ca.crt
      {{- if .certificate }}
      - key: {{ .certificate }}
        path: tls.crt
      - key: {{ .privateKey }}
        path: tls.key
      {{- end }}
    defaultMode: 0440
{{- end }}
{{- end }}
