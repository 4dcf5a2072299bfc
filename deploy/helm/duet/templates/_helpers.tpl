{{/* Names, labels and the pieces every component shares. */}}

{{- define "duet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "duet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "duet.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "duet.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* A component's resource name: <fullname>-<component>, at most 63 characters. */}}
{{- define "duet.component" -}}
{{- printf "%s-%s" (include "duet.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "duet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "duet.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "duet.labels" -}}
{{ include "duet.selectorLabels" . }}
app.kubernetes.io/part-of: duet
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "duet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "duet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image of a component: the CUDA image for a worker with a GPU. */}}
{{- define "duet.image" -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag -}}
{{- $repository := ternary .root.Values.image.cudaRepository .root.Values.image.repository .gpu -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{/* Where traces go: the configured collector, else the bundled Jaeger when enabled. */}}
{{- define "duet.otlpEndpoint" -}}
{{- if .Values.telemetry.otlpEndpoint -}}
{{- .Values.telemetry.otlpEndpoint -}}
{{- else if .Values.jaeger.enabled -}}
{{- printf "http://%s:4317" (include "duet.component" (dict "root" . "component" "jaeger")) -}}
{{- end -}}
{{- end -}}

{{/* Keys every service shares, as a dict of dotted configuration keys. */}}
{{- define "duet.commonSettings" -}}
{{- $s := dict -}}
{{- $_ := set $s "metrics_listen" (printf "0.0.0.0:%v" .root.Values.metrics.port) -}}
{{- $_ := set $s "log_json" .root.Values.logJson -}}
{{- $_ := set $s "drain_timeout_ms" (mul .values.drainSeconds 1000) -}}
{{- $_ := set $s "telemetry.otlp_endpoint" (include "duet.otlpEndpoint" .root) -}}
{{- $_ := set $s "telemetry.sampling_ratio" .root.Values.telemetry.samplingRatio -}}
{{- toJson $s -}}
{{- end -}}

{{/* A dict of dotted keys as TOML (sorted; dotted keys only, so no table can swallow the
keys after it). Values are written as JSON, which TOML reads for strings, numbers and bools. */}}
{{- define "duet.toml" -}}
{{- $lines := list -}}
{{- range $key, $value := . -}}
{{- $lines = append $lines (printf "%s = %s" $key (toJson $value)) -}}
{{- end -}}
{{- join "\n" $lines -}}
{{- end -}}

{{/* Environment every container of duet gets: where it runs, for trace resources. */}}
{{/* Whether the coordinator serves its HTTP API (with the public TLS when it is set). */}}
{{- define "duet.httpApi" -}}
{{- if gt (int .Values.coordinator.httpPort) 0 }}true{{ end -}}
{{- end -}}

{{- define "duet.env" -}}
- name: K8S_POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: K8S_NAMESPACE_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: K8S_NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
{{- end -}}

{{/*
The internal mutual-TLS Secret of a component ("coordinator", "draftWorker" or
"targetWorker"): its own from tls.componentSecrets, else tls.internalSecret.
*/}}
{{- define "duet.internalSecret" -}}
{{- $tls := .root.Values.tls -}}
{{- default $tls.internalSecret (get (default dict $tls.componentSecrets) .component) -}}
{{- end -}}

{{/*
The Secrets a pod mounts (README "Security"): its component's internal mutual-TLS Secret
(every pod), and for the coordinator ("public" true) the public TLS Secret and the bearer
token.
*/}}
{{- define "duet.secretList" -}}
{{- $v := .root.Values -}}
{{- $list := list -}}
{{- $internal := include "duet.internalSecret" . -}}
{{- if $internal }}{{ $list = append $list (list "tls-internal" $internal "/etc/duet-tls/internal") }}{{ end -}}
{{- if and .public $v.tls.publicSecret }}{{ $list = append $list (list "tls-public" $v.tls.publicSecret "/etc/duet-tls/public") }}{{ end -}}
{{- if and .public $v.authTokenSecret }}{{ $list = append $list (list "auth-token" $v.authTokenSecret "/etc/duet-auth") }}{{ end -}}
{{- toJson $list -}}
{{- end -}}

{{- define "duet.secretMounts" -}}
{{- range (include "duet.secretList" . | fromJsonArray) }}
- name: {{ index . 0 }}
  mountPath: {{ index . 2 }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "duet.secretVolumes" -}}
{{- range (include "duet.secretList" . | fromJsonArray) }}
- name: {{ index . 0 }}
  secret:
    secretName: {{ index . 1 }}
{{- end }}
{{- end -}}
