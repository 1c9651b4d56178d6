{{/* ---------------------------------------------------------------- names */}}

{{- define "kvtier.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvtier.fullname" -}}
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

{{- define "kvtier.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvtier.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selects the vLLM pods only (the in-chart Redis has component "redis"). */}}
{{- define "kvtier.vllmSelectorLabels" -}}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/component: vllm
{{- end }}

{{- define "kvtier.labels" -}}
helm.sh/chart: {{ include "kvtier.chart" . }}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvtier.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvtier.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvtier.redisName" -}}
{{- printf "%s-redis" (include "kvtier.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* ---------------------------------------------------------------- sizes */}}

{{/*
kvtier.bytes: a size as a whole byte count, printed as a decimal integer.
Argument: (list FIELD VALUE MODE)
  MODE "kvtier": kvtier's own size strings, case-insensitive, as kvtier.config.parse_size
                 reads them (B, KB/MB/GB/TB = 10^n, KiB/MiB/GiB/TiB and K/M/G/T = 2^n),
                 plus the Kubernetes forms Ki/Mi/Gi/Ti. Rendered into the JSON as bytes.
  MODE "k8s":    a Kubernetes memory quantity (Ki/Mi/Gi/Ti/Pi/Ei = 2^n, k/M/G/T/P/E = 10^n).
*/}}
{{- define "kvtier.bytes" -}}
{{- $field := index . 0 }}
{{- $v := index . 1 }}
{{- $mode := index . 2 }}
{{- if or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) }}
{{- if lt (float64 $v) 0.0 }}
{{- fail (printf "%s: %v is negative; give a size in bytes or a string like \"64GiB\"" $field $v) }}
{{- end }}
{{- printf "%d" (int64 (floor (float64 $v))) }}
{{- else if kindIs "string" $v }}
{{- $re := "^\\s*([0-9]+(\\.[0-9]+)?)\\s*([a-zA-Z]*)\\s*$" }}
{{- if not (regexMatch $re $v) }}
{{- fail (printf "%s: %q is not a size; give bytes or a number with a unit, like \"64GiB\" or \"64Gi\"" $field $v) }}
{{- end }}
{{- $num := regexReplaceAll $re $v "${1}" }}
{{- $unit := regexReplaceAll $re $v "${3}" }}
{{- $units := dict }}
{{- if eq $mode "k8s" }}
{{- $units = dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 "E" 1000000000000000000 }}
{{- else }}
{{- $unit = lower $unit }}
{{- $units = dict "" 1 "b" 1 "kb" 1000 "mb" 1000000 "gb" 1000000000 "tb" 1000000000000 "kib" 1024 "mib" 1048576 "gib" 1073741824 "tib" 1099511627776 "k" 1024 "m" 1048576 "g" 1073741824 "t" 1099511627776 "ki" 1024 "mi" 1048576 "gi" 1073741824 "ti" 1099511627776 }}
{{- end }}
{{- if not (hasKey $units $unit) }}
{{- fail (printf "%s: %q has an unknown unit %q; use one of %s" $field $v $unit (keys $units | sortAlpha | without "" | join ", ")) }}
{{- end }}
{{- printf "%d" (int64 (ceil (mulf (float64 $num) (index $units $unit)))) }}
{{- else }}
{{- fail (printf "%s: %v is not a size" $field $v) }}
{{- end }}
{{- end }}

{{/* GiB with two decimals, for messages. Argument: a byte count (string or number). */}}
{{- define "kvtier.gib" -}}
{{- printf "%.2f GiB" (divf (float64 .) 1073741824.0) }}
{{- end }}

{{/* ---------------------------------------------------------------- vLLM args */}}

{{/*
kvtier.argValue: the value of a flag in vllm.extraArgs ("--flag N" or "--flag=N"), or "".
A long flag is matched as vLLM reads it: --tensor_parallel_size is --tensor-parallel-size.
Argument: (list ARGS NAME ALIAS...)
*/}}
{{- define "kvtier.argValue" -}}
{{- $args := index . 0 }}
{{- $names := rest . }}
{{- $found := "" }}
{{- range $i, $a := $args }}
{{- $s := toString $a }}
{{- $key := regexFind "^--[^=]*" $s }}
{{- if and $key (not (contains "." $key)) }}
{{- $s = printf "%s%s" (replace "_" "-" $key) (trimPrefix $key $s) }}
{{- end }}
{{- range $names }}
{{- if hasPrefix (printf "%s=" .) $s }}
{{- $found = trimPrefix (printf "%s=" .) $s }}
{{- else if eq $s . }}
{{- if ge (add1 $i) (len $args) }}
{{- fail (printf "vllm.extraArgs: %s needs a value" .) }}
{{- end }}
{{- $found = toString (index $args (add1 $i)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $found }}
{{- end }}

{{/*
vLLM GPU workers in the pod (tensor x pipeline parallel), each with its own kvtier host
slab and its own share of the weight offload: from --tensor-parallel-size /
--pipeline-parallel-size in vllm.extraArgs, otherwise gpu.count (at least 1).
*/}}
{{- define "kvtier.workers" -}}
{{- $args := (concat (.Values.vllm.sizingArgs | default list) (.Values.vllm.extraArgs | default list)) }}
{{- $tp := include "kvtier.argValue" (list $args "--tensor-parallel-size" "-tp") }}
{{- $pp := include "kvtier.argValue" (list $args "--pipeline-parallel-size" "-pp") }}
{{- range $flag, $v := dict "--tensor-parallel-size" $tp "--pipeline-parallel-size" $pp }}
{{- if and $v (not (regexMatch "^[1-9][0-9]*$" $v)) }}
{{- fail (printf "vllm.extraArgs: %s %q is not a positive integer" $flag $v) }}
{{- end }}
{{- end }}
{{- if or $tp $pp }}
{{- $n := mul (int64 ($tp | default "1")) (int64 ($pp | default "1")) }}
{{- if and (not (kindIs "invalid" .Values.gpu.count)) (gt $n (int64 .Values.gpu.count)) }}
{{- fail (printf "vllm.extraArgs run %d GPU workers (tensor x pipeline parallel) but gpu.count is %v; raise gpu.count or leave it empty to follow the args" $n .Values.gpu.count) }}
{{- end }}
{{- $n }}
{{- else if kindIs "invalid" .Values.gpu.count }}
{{- print "1" }}
{{- else }}
{{- max 1 (int64 .Values.gpu.count) }}
{{- end }}
{{- end }}

{{/* GPUs requested: gpu.count, or one per vLLM worker when it is empty. */}}
{{- define "kvtier.gpuCount" -}}
{{- if kindIs "invalid" .Values.gpu.count }}
{{- include "kvtier.workers" . }}
{{- else }}
{{- int64 .Values.gpu.count }}
{{- end }}
{{- end }}

{{/*
--cpu-offload-gb as vLLM will see it: weightOffload.cpuOffloadGb, or the value in
vllm.extraArgs; setting both is an error.
*/}}
{{- define "kvtier.cpuOffloadGb" -}}
{{- $fromArgs := include "kvtier.argValue" (list (concat (.Values.vllm.sizingArgs | default list) (.Values.vllm.extraArgs | default list)) "--cpu-offload-gb") }}
{{- $v := .Values.weightOffload.cpuOffloadGb | default 0 }}
{{- if and $fromArgs (gt (float64 $v) 0.0) }}
{{- fail "--cpu-offload-gb is set twice: in weightOffload.cpuOffloadGb and in vllm.extraArgs; keep one" }}
{{- end }}
{{- if $fromArgs }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?$" $fromArgs) }}
{{- fail (printf "vllm.extraArgs: --cpu-offload-gb %q is not a number of GiB" $fromArgs) }}
{{- end }}
{{- $fromArgs }}
{{- else }}
{{- toString $v }}
{{- end }}
{{- end }}

{{/*
Host bytes of vLLM's weight offload for one GPU worker: weightOffload.hostBytes when
given (what `kvtier size` computes from the model's tensors), otherwise the budget
int(cpuOffloadGb * 2^30) rounded up to a power of two as pinning does (kvtier's
autosize uses the same bound), or the budget itself with disablePinMemory.
*/}}
{{- define "kvtier.offloadHostBytes" -}}
{{- $gb := float64 (include "kvtier.cpuOffloadGb" .) }}
{{- $wo := .Values.weightOffload }}
{{- if le $gb 0.0 }}
{{- print "0" }}
{{- else if and $wo.hostBytes (ne (toString $wo.hostBytes) "") }}
{{- include "kvtier.bytes" (list "weightOffload.hostBytes" $wo.hostBytes "kvtier") }}
{{- else }}
{{- $budget := int64 (floor (mulf $gb 1073741824.0)) }}
{{- if $wo.disablePinMemory }}
{{- $budget }}
{{- else }}
{{- $p := 1 }}
{{- range until 64 }}
{{- if lt $p $budget }}
{{- $p = mul $p 2 }}
{{- end }}
{{- end }}
{{- $p }}
{{- end }}
{{- end }}
{{- end }}

{{/* The model argument: a directory on the PVC, or the model name. */}}
{{- define "kvtier.modelPath" -}}
{{- $m := .Values.model }}
{{- if $m.pvc.claimName }}
{{- $path := trimAll "/" (toString $m.pvc.path) }}
{{- if $path }}
{{- printf "%s/%s" (trimSuffix "/" $m.pvc.mountPath) $path }}
{{- else }}
{{- $m.pvc.mountPath }}
{{- end }}
{{- else }}
{{- required "model.name is required (a model name, or set model.pvc.claimName)" $m.name }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- kvtier config */}}

{{/* The object tier URL kvtier uses (no credentials): kvtier.remoteUrl or the in-chart Redis. */}}
{{- define "kvtier.remoteUrl" -}}
{{- /* trimmed as kvtier strips it: " redis://..." is the same tier (and the same password) */}}
{{- $url := .Values.kvtier.remoteUrl | default "" | toString | trim }}
{{- if and .Values.redis.enabled $url }}
{{- fail "redis.enabled deploys a Redis that kvtier uses as its object tier; leave kvtier.remoteUrl empty, or disable redis.enabled to use your own" }}
{{- end }}
{{- include "kvtier.refuseCredentials" (list "kvtier.remoteUrl" $url) }}
{{- if and .Values.redis.enabled .Values.redis.tls.enabled }}
{{- printf "rediss://%s:6379/0?ssl_ca_certs=%s/ca.crt" (include "kvtier.redisName" .) (include "kvtier.redisCaDir" .) }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s:6379/0" (include "kvtier.redisName" .) }}
{{- else }}
{{- $url }}
{{- end }}
{{- end }}

{{/*
kvtier.refuseCredentials: fail when a URL holds a credential anywhere a pod spec would show
it: user:password@ (or a user@), a query argument named like one (password=, pwd=,
token=, secret=, ...key=, auth=, sig=, cred=: redis-py takes ?password=, S3 presigned URLs
carry X-Amz-Signature= and X-Amz-Credential=), or a query argument whose name is
percent-encoded (clients decode names, so pass%77ord= is password=). ssl_keyfile= names
a file, not a secret. The URL may be anywhere in the value: after spaces (kvtier strips
them), inside a JSON argument, its slashes JSON-escaped (:\/\/). Argument: (list FIELD URL).
*/}}
{{- define "kvtier.refuseCredentials" -}}
{{- $field := index . 0 }}
{{- $url := toString (index . 1) }}
{{- $hint := "they would be readable in the pod spec (kubectl get -o yaml). Give a Redis password as kvtier.redis.existingSecret, S3 keys as kvtier.s3.existingSecret" }}
{{- if regexMatch "[a-zA-Z][a-zA-Z0-9+.-]*:(//|\\\\/\\\\/)[^/?#]*@" $url }}
{{- fail (printf "%s holds credentials (user:password@); %s" $field $hint) }}
{{- end }}
{{- $query := regexReplaceAll "(?i)[?&;]ssl_keyfile=[^&;#]*" (regexReplaceAll "^[^?#]*" $url "") "" }}
{{- if regexMatch "[?&;#][^=&;#]*%" $query }}
{{- fail (printf "%s holds credentials or may: a query argument with a percent-encoded name; write its name plainly. %s" $field $hint) }}
{{- end }}
{{- if regexMatch "(?i)[?&;#][^=&;#]*(pass|pwd|secret|token|key|auth|sig|cred)[^=&;#]*=" $query }}
{{- fail (printf "%s holds credentials (a password=, token=, secret= or key= argument); %s" $field $hint) }}
{{- end }}
{{- end }}

{{/*
Every value that reaches the vLLM container's args or plain env is free of credentials:
the object tier URL, the S3 endpoint, URLs in kvtier.extraConfig, vllm.extraArgs and
vllm.env values.
*/}}
{{- define "kvtier.checkCredentials" -}}
{{- $k := .Values.kvtier }}
{{- $urlish := ":(//|\\\\/\\\\/)" }}
{{- include "kvtier.refuseCredentials" (list "kvtier.remoteUrl" ($k.remoteUrl | default "")) }}
{{- include "kvtier.refuseCredentials" (list "kvtier.s3.endpointUrl" ($k.s3.endpointUrl | default "")) }}
{{- range $key, $val := $k.extraConfig }}
{{- $text := ternary $val (toJson $val) (kindIs "string" $val) }}
{{- if regexMatch $urlish $text }}
{{- include "kvtier.refuseCredentials" (list (printf "kvtier.extraConfig.%s" $key) $text) }}
{{- end }}
{{- end }}
{{- range $key := list "command" "sizingArgs" "extraArgs" }}
{{- range $i, $a := index $.Values.vllm $key | default list }}
{{- if regexMatch $urlish (toString $a) }}
{{- include "kvtier.refuseCredentials" (list (printf "vllm.%s[%d]" $key $i) (toString $a)) }}
{{- end }}
{{- end }}
{{- end }}
{{- range .Values.vllm.env }}
{{- if and (kindIs "string" .value) (regexMatch $urlish (toString .value)) }}
{{- include "kvtier.refuseCredentials" (list (printf "vllm.env %s" .name) .value) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
kvtier.vllmFlag: the long option a vLLM argument sets, as vLLM's FlexibleArgumentParser
reads it: the name before "=" and before the first "." (a dotted --a.b.c=v sets key b.c
of --a's JSON and replaces all of --a), underscores read as dashes
(--kv_transfer_config is --kv-transfer-config); "" when the argument is no long option.
Argument: the argument.
*/}}
{{- define "kvtier.vllmFlag" -}}
{{- replace "_" "-" (regexFind "^--[^=.]*" (toString .)) }}
{{- end }}

{{/*
vLLM's --kv-transfer-config is the chart's (the connector, its signing, its URL): no
argument may set it, in any spelling vLLM takes: underscores for dashes, a dotted
--kv-transfer-config.key=value (vLLM turns it into a whole --kv-transfer-config), or an
abbreviation (vLLM's argparse takes an unambiguous prefix such as --kv-transfer or --kv-t).
The message names the flag, never its value (it may hold a password).
*/}}
{{- define "kvtier.checkVllmArgs" -}}
{{- $full := "--kv-transfer-config" }}
{{- range $key := list "command" "sizingArgs" "extraArgs" }}
{{- range $i, $a := index $.Values.vllm $key | default list }}
{{- $flag := include "kvtier.vllmFlag" $a }}
{{- if and (hasPrefix "--kv-t" $flag) (hasPrefix $flag $full) }}
{{- fail (printf "vllm.%s[%d] (%s) sets vLLM's --kv-transfer-config: vLLM args must not hold --kv-transfer-config in any spelling vLLM reads (_ for -, a dotted --kv-transfer-config.key=value, a prefix such as --kv-transfer); the chart renders it from the kvtier values, set those instead" $key $i (regexFind "^--[^=]*" (toString $a))) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Where the vLLM pods find the in-chart Redis' CA certificate (redis.tls). */}}
{{- define "kvtier.redisCaDir" -}}
/etc/kvtier/redis-tls
{{- end }}

{{/* The in-chart Redis' redis.conf. */}}
{{- define "kvtier.redisConf" -}}
# kvtier's in-chart Redis: a cache, nothing is persisted.
bind * -::*
protected-mode yes
{{- if .Values.redis.tls.enabled }}
port 0
tls-port 6379
tls-cert-file /etc/redis/tls/tls.crt
tls-key-file /etc/redis/tls/tls.key
tls-ca-cert-file /etc/redis/tls/ca.crt
# Clients authenticate with the password; they need no certificate.
tls-auth-clients no
{{- else }}
port 6379
{{- end }}
save ""
appendonly no
dir /data
maxmemory {{ .Values.redis.maxmemory }}
maxmemory-policy allkeys-lru
# The default user's password and rules: written by the init container from the Secret.
aclfile /run/redis/users.acl
{{- end }}

{{/* The Secret the chart generates for the in-chart Redis when none is given. */}}
{{- define "kvtier.redisAuthSecret" -}}
{{- printf "%s-auth" (include "kvtier.redisName" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* True ("true") when the chart generates the in-chart Redis' password Secret. */}}
{{- define "kvtier.redisGeneratesSecret" -}}
{{- if and .Values.redis.enabled (not .Values.redis.existingSecret) (not .Values.kvtier.redis.existingSecret) }}true{{ end }}
{{- end }}

{{/*
The Secret holding the Redis password, if any. The in-chart Redis always has one:
redis.existingSecret, else kvtier.redis.existingSecret, else the generated one; the
Redis server and the vLLM pods read the same Secret.
*/}}
{{- define "kvtier.redisSecret" -}}
{{- if .Values.redis.enabled }}
{{- .Values.redis.existingSecret | default .Values.kvtier.redis.existingSecret | default (include "kvtier.redisAuthSecret" .) }}
{{- else }}
{{- .Values.kvtier.redis.existingSecret }}
{{- end }}
{{- end }}

{{/*
An image reference: repository:tag (tag empty: DEFAULT), then @digest when given.
Argument: (dict "image" IMAGE-VALUES "default" DEFAULT-TAG)
*/}}
{{- define "kvtier.image" -}}
{{- $ref := .image.repository }}
{{- $tag := toString (.image.tag | default .default) }}
{{- if $tag }}
{{- $ref = printf "%s:%s" $ref $tag }}
{{- end }}
{{- if .image.digest }}
{{- $ref = printf "%s@%s" $ref .image.digest }}
{{- end }}
{{- $ref }}
{{- end }}

{{/*
An object tier without an HMAC key lets anyone who can write it feed KV to every
replica: refuse it unless kvtier.allowUnsignedChunks says so. An encryption key
counts: AES-GCM authenticates every sealed chunk, and unsealed ones are refused.
*/}}
{{- define "kvtier.checkSigning" -}}
{{- $k := .Values.kvtier }}
{{- $url := include "kvtier.remoteUrl" . }}
{{- $signed := include "kvtier.signed" . }}
{{- $envUrl := hasKey (include "kvtier.vllmEnvNames" . | fromJson) "KVTIER_REMOTE_URL" }}
{{- if and (or $url $envUrl) (not $signed) (not $k.allowUnsignedChunks) }}
{{- $what := printf "kvtier.remoteUrl %q is an object tier" $url }}
{{- if .Values.redis.enabled }}
{{- $what = "the in-chart Redis (redis.enabled) is an object tier" }}
{{- else if not $url }}
{{- $what = "KVTIER_REMOTE_URL in vllm.env (it overrides remote_url) names an object tier" }}
{{- end }}
{{- fail (printf "%s that every replica loads KV from, but no HMAC key signs its chunks (and no encryption key seals them): anyone who can write it could feed KV to every replica. Set kvtier.hmac.existingSecret to a Secret holding a key (kubectl create secret generic kvtier-hmac --from-literal=hmac-key=\"$(openssl rand -hex 32)\"), or kvtier.encryption.existingSecret to one holding an encryption key (kubectl create secret generic kvtier-encryption --from-literal=encryption-key=\"$(openssl rand -hex 32)\"), or set kvtier.allowUnsignedChunks=true to accept unsigned chunks." $what) }}
{{- end }}
{{- end }}

{{/* "true" when chunks are authenticated: an HMAC key or an encryption key (AES-GCM),
from the chart's values, kvtier.extraConfig, or the KVTIER_* overrides in vllm.env. */}}
{{- define "kvtier.signed" -}}
{{- $k := .Values.kvtier }}
{{- $extra := $k.extraConfig | default dict }}
{{- $enc := $k.encryption | default dict }}
{{- $env := include "kvtier.vllmEnvNames" . | fromJson }}
{{- $envKey := false }}
{{- range list "KVTIER_HMAC_KEY_ENV" "KVTIER_HMAC_KEY_FILE" "KVTIER_ENCRYPTION_KEY_ENV" "KVTIER_ENCRYPTION_KEY_FILE" }}
{{- if hasKey $env . }}{{ $envKey = true }}{{ end }}
{{- end }}
{{- if or $k.hmac.existingSecret (get $extra "hmac_key_file") $enc.existingSecret (get $extra "encryption_key_file") $envKey }}true{{ end }}
{{- end }}

{{/* The names set in vllm.env, as a JSON object (name -> true). */}}
{{- define "kvtier.vllmEnvNames" -}}
{{- $names := dict }}
{{- range .Values.vllm.env }}
{{- $_ := set $names (toString .name) true }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/*
checkov skip annotations: one "checkov.io/skipN: ID=reason" per entry.
Argument: a list of "ID=reason" strings (a reason holds no "=").
*/}}
{{- define "kvtier.checkovSkips" -}}
{{- range $i, $skip := . }}
checkov.io/skip{{ add1 $i }}: {{ $skip | quote }}
{{- end }}
{{- end }}

{{/* The checkov skip for a container without a CPU limit (the vLLM server, Redis). */}}
{{- define "kvtier.cpuLimitSkip" -}}
CKV_K8S_11=No CPU limit on purpose: a CFS quota throttles the server's threads in bursts and stalls every request in flight, while the CPU request reserves the cores. Set the limits.cpu value to add one
{{- end }}

{{/*
kv_connector_extra_config: exactly the snake_case keys kvtier.config.load_config accepts.
Sizes are rendered as byte counts so kvtier and the chart read them the same way.
*/}}
{{- define "kvtier.extraConfig" -}}
{{- $k := .Values.kvtier }}
{{- $cfg := dict }}
{{- if eq (lower (toString $k.cpuBytes)) "auto" }}
{{- $_ := set $cfg "cpu_bytes" "auto" }}
{{- else }}
{{- $_ := set $cfg "cpu_bytes" (int64 (include "kvtier.bytes" (list "kvtier.cpuBytes" $k.cpuBytes "kvtier"))) }}
{{- end }}
{{- $_ := set $cfg "cpu_headroom_bytes" (int64 (include "kvtier.bytes" (list "kvtier.headroom" $k.headroom "kvtier"))) }}
{{- $_ = set $cfg "chunk_size" (int64 $k.chunkSize) }}
{{- $_ = set $cfg "write_policy" $k.writePolicy }}
{{- if $k.namespace }}
{{- $_ = set $cfg "namespace" $k.namespace }}
{{- end }}
{{- $url := include "kvtier.remoteUrl" . }}
{{- if $url }}
{{- $_ = set $cfg "remote_url" $url }}
{{- end }}
{{- if $k.s3.endpointUrl }}
{{- $_ = set $cfg "s3_endpoint_url" $k.s3.endpointUrl }}
{{- end }}
{{- if $k.hmac.existingSecret }}
{{- $_ = set $cfg "hmac_key_env" $k.hmac.envName }}
{{- end }}
{{- if $k.encryption.existingSecret }}
{{- $_ = set $cfg "encryption_key_env" $k.encryption.envName }}
{{- end }}
{{- $owned := list "remote_url" "s3_endpoint_url" "hmac_key_env" "encryption_key_env" "namespace" }}
{{- range $key, $val := $k.extraConfig }}
{{- if or (hasKey $cfg $key) (has $key $owned) }}
{{- fail (printf "kvtier.extraConfig.%s: the chart sets %s from its own values; set it there" $key $key) }}
{{- end }}
{{- $_ = set $cfg $key $val }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/* The whole --kv-transfer-config JSON. */}}
{{- define "kvtier.transferConfig" -}}
{{- $extra := include "kvtier.extraConfig" . | fromJson }}
{{- toJson (dict "kv_connector" "KVTierConnector" "kv_connector_module_path" "kvtier.connectors.vllm" "kv_role" "kv_both" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" $extra) }}
{{- end }}

{{/*
How long vLLM must give its engine on SIGTERM for kvtier's queued object-tier writes to
flush: shutdown_flush_s (10) plus 10 s, kvtier.config KVTierConfig.vllm_shutdown_timeout_s.
"" when nothing is written to an object tier. vLLM's defaults (--shutdown-timeout 0,
VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS 5) kill the engine with those writes still queued.
*/}}
{{- define "kvtier.shutdownTimeout" -}}
{{- $extra := include "kvtier.extraConfig" . | fromJson }}
{{- if and (get $extra "remote_url") (ne (toString (get $extra "write_policy")) "none") }}
{{- $flush := 10.0 }}
{{- if hasKey $extra "shutdown_flush_s" }}
{{- $flush = float64 (get $extra "shutdown_flush_s") }}
{{- end }}
{{- add (int64 (ceil $flush)) 10 }}
{{- end }}
{{- end }}

{{/*
The startupProbe's failureThreshold: startupProbe.failureThreshold, plus warm-up's time in
probe periods when kvtier.extraConfig.warmup is true. vLLM answers /health only once each
worker's warm-up ended or timed out (kvtier.connectors.worker.warmup: warmup_timeout_s, 60 unless
set, and one read), so a probe sized for loading the model alone would restart a warming pod.
*/}}
{{- define "kvtier.startupFailureThreshold" -}}
{{- $base := int64 .Values.startupProbe.failureThreshold }}
{{- $warm := include "kvtier.warmupSeconds" . }}
{{- if $warm }}
{{- $period := max 1 (int64 .Values.startupProbe.periodSeconds) }}
{{- add $base (int64 (ceil (divf (float64 $warm) $period))) 1 }}
{{- else }}
{{- $base }}
{{- end }}
{{- end }}

{{/* warmup_timeout_s in whole seconds when kvtier.extraConfig.warmup is true, else "". */}}
{{- define "kvtier.warmupSeconds" -}}
{{- $extra := include "kvtier.extraConfig" . | fromJson }}
{{- if eq (lower (toString (get $extra "warmup"))) "true" }}
{{- $timeout := 60.0 }}
{{- if hasKey $extra "warmup_timeout_s" }}
{{- $timeout = float64 (get $extra "warmup_timeout_s") }}
{{- end }}
{{- int64 (ceil $timeout) }}
{{- end }}
{{- end }}

{{/*
vLLM's --shutdown-timeout as the pod runs it (vllm.extraArgs, else the chart's), which
Kubernetes must not cut short: terminationGracePeriodSeconds has to exceed it.
*/}}
{{- define "kvtier.checkShutdown" -}}
{{- $stop := include "kvtier.argValue" (list (concat (.Values.vllm.sizingArgs | default list) (.Values.vllm.extraArgs | default list)) "--shutdown-timeout") | default (include "kvtier.shutdownTimeout" .) }}
{{- if and $stop (le (int64 .Values.terminationGracePeriodSeconds) (add (int64 $stop) 5)) }}
{{- fail (printf "terminationGracePeriodSeconds is %v but vLLM may take --shutdown-timeout %v s to stop (flushing kvtier's queued object-tier writes) plus its exit: set terminationGracePeriodSeconds above %v, or lower kvtier.extraConfig.shutdown_flush_s" .Values.terminationGracePeriodSeconds $stop (add (int64 $stop) 5)) }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- memory check */}}

{{/*
The container's memory request and limit must cover what the planner
(kvtier.sizing.memory_plan.host_total_bytes) adds up:
  workers x (host tier + weight-offload host bytes) + headroom.
With cpuBytes "auto" the tier is sized at startup from the limit, so the limit
must leave room above workers x offload + headroom.
*/}}
{{- define "kvtier.checkMemory" -}}
{{- $res := .Values.resources | default dict }}
{{- $limits := $res.limits | default dict }}
{{- $requests := $res.requests | default dict }}
{{- $limit := required "resources.limits.memory is required: kvtier pins its host tier, so the pod needs a memory limit that covers it (see `kvtier size`)" $limits.memory }}
{{- $workers := int64 (include "kvtier.workers" .) }}
{{- $offload := int64 (include "kvtier.offloadHostBytes" .) }}
{{- $headroom := int64 (include "kvtier.bytes" (list "kvtier.headroom" .Values.kvtier.headroom "kvtier")) }}
{{- $auto := eq (lower (toString .Values.kvtier.cpuBytes)) "auto" }}
{{- $tier := 0 }}
{{- if not $auto }}
{{- $tier = int64 (include "kvtier.bytes" (list "kvtier.cpuBytes" .Values.kvtier.cpuBytes "kvtier")) }}
{{- end }}
{{- $need := add (mul $workers (add $tier $offload)) $headroom }}
{{- $gb := include "kvtier.cpuOffloadGb" . }}
{{- $how := "" }}
{{- if gt $offload 0 }}
{{- if and .Values.weightOffload.hostBytes (ne (toString .Values.weightOffload.hostBytes) "") }}
{{- $how = " (weightOffload.hostBytes)" }}
{{- else if .Values.weightOffload.disablePinMemory }}
{{- $how = printf " (--cpu-offload-gb %s, unpinned)" $gb }}
{{- else }}
{{- $how = printf " (--cpu-offload-gb %s rounded up to a power of two as pinning does; weightOffload.hostBytes from `kvtier size --model` is exact)" $gb }}
{{- end }}
{{- end }}
{{- $checks := list (list "resources.limits.memory" $limit) }}
{{- if $requests.memory }}
{{- $checks = append $checks (list "resources.requests.memory" $requests.memory) }}
{{- end }}
{{- range $checks }}
{{- $field := index . 0 }}
{{- $have := int64 (include "kvtier.bytes" (list $field (index . 1) "k8s")) }}
{{- if $auto }}
{{- if le $have $need }}
{{- fail (printf "%s (%v = %s) is too small: with kvtier.cpuBytes \"auto\" the host tier gets what is left after %d worker(s) x weight offload %s%s + headroom %s = %s, which is nothing. Raise %s above %s." $field (index . 1) (include "kvtier.gib" $have) $workers (include "kvtier.gib" $offload) $how (include "kvtier.gib" $headroom) (include "kvtier.gib" $need) $field (include "kvtier.gib" $need)) }}
{{- end }}
{{- else if lt $have $need }}
{{- fail (printf "%s (%v = %s) is too small for the kvtier host tier: %d worker(s) x (kvtier.cpuBytes %v = %s + weight offload %s%s) + headroom %s = %s (%d bytes). Raise %s to at least %s, or lower kvtier.cpuBytes." $field (index . 1) (include "kvtier.gib" $have) $workers $.Values.kvtier.cpuBytes (include "kvtier.gib" $tier) (include "kvtier.gib" $offload) $how (include "kvtier.gib" $headroom) (include "kvtier.gib" $need) $need $field (include "kvtier.gib" $need)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* An emptyDir volume source, with a sizeLimit when one is given. Argument: the limit. */}}
{{- define "kvtier.emptyDir" -}}
{{- if . }}
{{- toJson (dict "sizeLimit" (toString .)) }}
{{- else }}
{{- print "{}" }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- files */}}

{{/* A file the chart carries (files/ holds copies of deploy/grafana and deploy/prometheus: `make chart-files`). */}}
{{- define "kvtier.file" -}}
{{- $content := .root.Files.Get .path }}
{{- if not $content }}
{{- fail (printf "%s is missing or empty in the chart: it is a copy of %s in the kvtier repository (make chart-files); package the chart from a full checkout" .path .source) }}
{{- end }}
{{- $content }}
{{- end }}

{{/*
HOME and the caches vLLM and its libraries write, all on the writableDirs emptyDirs
(the root file system is read-only). USER: getpass.getuser() (torch, Triton) needs a
name for a UID without a passwd entry.
*/}}
{{- define "kvtier.homeDir" -}}
{{- trimSuffix "/" .Values.writableDirs.home.path }}
{{- end }}

{{- define "kvtier.dirEnv" -}}
{{- $home := include "kvtier.homeDir" . }}
- name: HOME
  value: {{ $home | quote }}
- name: USER
  value: "vllm"
- name: XDG_CACHE_HOME
  value: {{ printf "%s/.cache" $home | quote }}
- name: XDG_CONFIG_HOME
  value: {{ printf "%s/.config" $home | quote }}
- name: HF_HOME
  value: {{ printf "%s/.cache/huggingface" $home | quote }}
- name: VLLM_CACHE_ROOT
  value: {{ printf "%s/.cache/vllm" $home | quote }}
- name: VLLM_CONFIG_ROOT
  value: {{ printf "%s/.config/vllm" $home | quote }}
- name: TRITON_CACHE_DIR
  value: {{ printf "%s/.cache/triton" $home | quote }}
- name: TORCHINDUCTOR_CACHE_DIR
  value: {{ printf "%s/.cache/torchinductor" $home | quote }}
{{- end }}

{{/* The vLLM container's environment: credentials only as secretKeyRef. */}}
{{- define "kvtier.env" -}}
{{ include "kvtier.dirEnv" . }}
{{- $k := .Values.kvtier }}
{{- $redisSecret := include "kvtier.redisSecret" . }}
{{- $remoteUrl := include "kvtier.remoteUrl" . }}
{{- if $k.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $k.s3.existingSecret }}
      key: {{ $k.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $k.s3.existingSecret }}
      key: {{ $k.s3.secretAccessKeyKey }}
{{- end }}
{{- if $k.s3.region }}
- name: AWS_DEFAULT_REGION
  value: {{ $k.s3.region | quote }}
{{- end }}
{{- if $redisSecret }}
# The password stays in the Secret; Kubernetes expands $(REDIS_PASSWORD)
# into the URL in the container's environment only. KVTIER_REMOTE_URL
# overrides remote_url in --kv-transfer-config.
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $redisSecret }}
      key: {{ $k.redis.passwordKey }}
- name: KVTIER_REMOTE_URL
  value: {{ regexReplaceAll "^(rediss?(\\+cluster)?)://" $remoteUrl (printf "${1}://%s:$(REDIS_PASSWORD)@" ($k.redis.username | default "")) | quote }}
{{- end }}
{{- if $k.hmac.existingSecret }}
- name: {{ $k.hmac.envName }}
  valueFrom:
    secretKeyRef:
      name: {{ $k.hmac.existingSecret }}
      key: {{ $k.hmac.key }}
{{- end }}
{{- if $k.encryption.existingSecret }}
- name: {{ $k.encryption.envName }}
  valueFrom:
    secretKeyRef:
      name: {{ $k.encryption.existingSecret }}
      key: {{ $k.encryption.key }}
{{- end }}
{{- if and .Values.weightOffload.disablePinMemory (gt (float64 (include "kvtier.cpuOffloadGb" .)) 0.0) }}
- name: VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY
  value: "1"
{{- end }}
{{- $stop := include "kvtier.shutdownTimeout" . }}
{{- $named := dict }}
{{- range .Values.vllm.env }}
{{- $_ := set $named (toString .name) true }}
{{- end }}
{{- if and $stop (not (hasKey $named "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS")) }}
# Worker processes get this long to flush queued object-tier writes (kvtier.shutdownTimeout).
- name: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS
  value: {{ $stop | quote }}
{{- end }}
{{- $warm := include "kvtier.warmupSeconds" . }}
{{- if and $warm (not (hasKey $named "VLLM_ENGINE_READY_TIMEOUT_S")) }}
# vLLM waits 600 s for its engine to load; kvtier's warm-up runs inside that wait.
- name: VLLM_ENGINE_READY_TIMEOUT_S
  value: {{ add 600 (int64 $warm) | quote }}
{{- end }}
{{- with .Values.vllm.env }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end }}
