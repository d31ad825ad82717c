{{/*
Names are fixed, not derived from the release: the admission policies match the service account
"healthagent", the agent finds its budget Leases by name, and a cluster runs one agent.
*/}}
{{- define "healthagent.namespace" -}}
{{ .Values.namespace.name }}
{{- end }}

{{/* The labels every object of the Kustomize base carries, plus Helm's own. */}}
{{- define "healthagent.labels" -}}
app.kubernetes.io/name: healthagent
app.kubernetes.io/part-of: healthagent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The condition vocabulary: the value, else the preset's. */}}
{{- define "healthagent.vocabulary" -}}
{{- if .Values.conditionVocabulary -}}
{{ .Values.conditionVocabulary }}
{{- else if eq .Values.preset "eks-node-repair" -}}
eks
{{- else -}}
healthagent
{{- end }}
{{- end }}

{{/* A generated file of files/ (deploy/generate.py) with its namespace set to the agent's. */}}
{{- define "healthagent.generated" -}}
{{- $object := .root.Files.Get .file | fromYaml }}
{{- $_ := set $object.metadata "namespace" (include "healthagent.namespace" .root) }}
{{ toYaml $object }}
{{- end }}
