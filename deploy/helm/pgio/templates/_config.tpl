{{/*
pgio.toml from .Values.config (docs/configuration.md). Written field by field rather than with
toToml: Helm reads numbers in values as floats, and pgio wants integers.
*/}}
{{- define "pgio.toml" -}}
{{- $c := .Values.config -}}
listen = {{ include "pgio.tomlString" (printf "[::]:%d" (int .Values.port)) }}
rescan_interval_secs = {{ int $c.rescan_interval_secs }}
bpf_stats = {{ $c.bpf_stats }}
longhorn_device_dir = {{ include "pgio.tomlString" $c.longhorn_device_dir }}
pod_labels = {{ $c.pod_labels }}
pod_log_dir = {{ include "pgio.tomlString" $c.pod_log_dir }}
container_log_dir = {{ include "pgio.tomlString" $c.container_log_dir }}
series_retention_secs = {{ int $c.series_retention_secs }}
max_series = {{ int $c.max_series }}
max_series_per_app = {{ int $c.max_series_per_app }}
max_series_per_group = {{ int $c.max_series_per_group }}
max_label_len = {{ int $c.max_label_len }}
hist_map_max_entries = {{ int $c.hist_map_max_entries }}
http_header_timeout_secs = {{ int $c.http_header_timeout_secs }}
http_idle_timeout_secs = {{ int $c.http_idle_timeout_secs }}
http_max_connections = {{ int $c.http_max_connections }}
block_inflight_timeout_secs = {{ int $c.block_inflight_timeout_secs }}
queue_blame = {{ $c.queue_blame }}
syscall_rows = {{ $c.syscall_rows }}
queries = {{ $c.queries }}
query_probes = {{ $c.query_probes }}
query_args_at_entry = {{ $c.query_args_at_entry }}
query_ids = {{ $c.query_ids }}
max_query_ids = {{ int $c.max_query_ids }}
relations = {{ $c.relations }}
max_relations = {{ int $c.max_relations }}
max_postgres_binaries = {{ int $c.max_postgres_binaries }}
{{- range $rule := $c.rules }}

[[rule]]
app = {{ include "pgio.tomlString" (required "config.rules[].app is required" .app) }}
{{- if .role }}
role = {{ include "pgio.tomlString" .role }}
{{- end }}
{{- range $key := list "comm" "exe" "cmdline" }}
{{- with index $rule $key }}
{{ $key }} = {{ include "pgio.tomlString" . }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
