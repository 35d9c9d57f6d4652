{{/* Name of the chart, overridable. */}}
{{- define "pgio.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified name: the release name when it contains the chart name. */}}
{{- define "pgio.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pgio.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pgio.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pgio.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pgio.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: node-agent
app.kubernetes.io/part-of: pgio
{{- end }}

{{- define "pgio.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pgio.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A TOML basic string: JSON's escapes (\" \\ \n \uXXXX) are TOML's too. */}}
{{- define "pgio.tomlString" -}}
{{- toJson (toString .) }}
{{- end }}

{{/* <repository>@<digest> when a digest is given, else <repository>:<tag or appVersion>. */}}
{{- define "pgio.image" -}}
{{- $i := .Values.image }}
{{- if $i.digest }}
{{- printf "%s@%s" $i.repository $i.digest }}
{{- else }}
{{- printf "%s:%s" $i.repository ($i.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* appArmorProfile as the pre-1.30 annotation's value. */}}
{{- define "pgio.appArmorAnnotation" -}}
{{- if eq .type "Unconfined" }}unconfined
{{- else if eq .type "RuntimeDefault" }}runtime/default
{{- else if eq .type "Localhost" }}localhost/{{ required "appArmorProfile.localhostProfile is required with type Localhost" .localhostProfile }}
{{- else }}{{ fail (printf "appArmorProfile.type %q: expected Unconfined, RuntimeDefault or Localhost" .type) }}
{{- end }}
{{- end }}
