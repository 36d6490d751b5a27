{{- define "tunejob.labels" -}}
app.kubernetes.io/name: tunejob
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "tunejob.selector" -}}
app.kubernetes.io/name: tunejob
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The environment of every tunejob container: the job store, the broker, the bucket. */}}
{{- define "tunejob.env" -}}
- name: TUNEJOB_DATABASE_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.database.urlSecret.name }}, key: {{ .Values.database.urlSecret.key }}}}
- name: TUNEJOB_BROKER_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.redis.urlSecret.name }}, key: {{ .Values.redis.urlSecret.key }}}}
{{- with .Values.secretKey.name }}
- name: TUNEJOB_SECRET_KEY
  valueFrom: {secretKeyRef: {name: {{ . }}, key: {{ $.Values.secretKey.key }}}}
{{- end }}
- {name: TUNEJOB_DATA_DIR, value: /data}
- {name: TUNEJOB_STORAGE_URL, value: {{ .Values.storage.url | quote }}}
- {name: TUNEJOB_STORAGE_CACHE_BYTES, value: {{ .Values.storage.cacheBytes | quote }}}
{{- with .Values.storage.presignedSeconds }}
- {name: TUNEJOB_STORAGE_PRESIGNED_SECONDS, value: {{ . | quote }}}
{{- end }}
{{- with .Values.storage.endpoint }}
- {name: AWS_ENDPOINT_URL, value: {{ . | quote }}}
{{- end }}
- {name: AWS_REGION, value: {{ .Values.storage.region | quote }}}
{{- with .Values.storage.credentialsSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom: {secretKeyRef: {name: {{ . }}, key: AWS_ACCESS_KEY_ID}}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom: {secretKeyRef: {name: {{ . }}, key: AWS_SECRET_ACCESS_KEY}}
{{- end }}
- {name: HF_HUB_OFFLINE, value: "1"}
{{- range $name, $value := .Values.settings }}
- {name: {{ $name }}, value: {{ $value | quote }}}
{{- end }}
{{- end }}
