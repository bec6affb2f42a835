{{/*
Names, labels and derived values shared by the templates.
*/}}

{{- define "gpuslice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Object-name prefix. Kept short (<= 40 chars) so "<fullname>-scheduler-lease" etc. stay valid.
A Service's name is a DNS-1035 label: the dots Helm allows in release names become dashes,
and every dash the cut leaves at the end goes (gpuslice.validate refuses what is still not one).
*/}}
{{- define "gpuslice.fullname" -}}
{{- $full := "" -}}
{{- if .Values.fullnameOverride -}}
{{- $full = .Values.fullnameOverride -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- $full = ternary .Release.Name (printf "%s-%s" .Release.Name $name) (contains $name .Release.Name) -}}
{{- end -}}
{{- regexReplaceAll "-+$" ($full | replace "." "-" | trunc 40) "" -}}
{{- end -}}

{{- define "gpuslice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "gpuslice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuslice
{{- end -}}

{{/* Selector labels of one component: include "gpuslice.selectorLabels" (list . "webhook") */}}
{{- define "gpuslice.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "gpuslice.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Labels of a component's pods: its selector labels plus the version. */}}
{{- define "gpuslice.podLabels" -}}
{{ include "gpuslice.selectorLabels" . }}
app.kubernetes.io/version: {{ (index . 0).Chart.AppVersion | quote }}
app.kubernetes.io/part-of: gpuslice
{{- end -}}

{{- define "gpuslice.serviceName" -}}
{{- include "gpuslice.fullname" . -}}
{{- end -}}

{{- define "gpuslice.webhookConfigName" -}}
{{- include "gpuslice.fullname" . -}}
{{- end -}}

{{- define "gpuslice.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "gpuslice.fullname" .)) .Values.tls.secretName -}}
{{- end -}}

{{- define "gpuslice.webhookServiceAccount" -}}
{{- include "gpuslice.fullname" . -}}
{{- end -}}

{{- define "gpuslice.agentServiceAccount" -}}
{{- printf "%s-agent" (include "gpuslice.fullname" .) -}}
{{- end -}}

{{- define "gpuslice.leaseName" -}}
{{- default .Values.scheduler.name .Values.scheduler.leaseName -}}
{{- end -}}

{{/* Where the service, the bootstrap and the scheduler find ca.crt / tls.crt / tls.key. */}}
{{- define "gpuslice.certDir" -}}
/etc/gpuslice/tls
{{- end -}}

{{/*
An image reference from {repository, tag, digest} and the tag used when none is set:
repository:tag without a digest (the rendering of every release so far); with one,
repository:tag@digest when the operator set the tag, else repository@digest. The runtime pulls
by the digest either way; a tag the operator wrote is kept as the human-readable name, but a
default tag (appVersion, the cluster's version) is never put beside a digest it may not name.
*/}}
{{- define "gpuslice.imageRef" -}}
{{- $image := .image -}}
{{- if not $image.digest -}}
{{- printf "%s:%s" $image.repository (default .defaultTag $image.tag) -}}
{{- else if $image.tag -}}
{{- printf "%s:%s@%s" $image.repository $image.tag $image.digest -}}
{{- else -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- end -}}
{{- end -}}

{{- define "gpuslice.webhookImage" -}}
{{- include "gpuslice.imageRef" (dict "image" .Values.webhook.image "defaultTag" .Chart.AppVersion) -}}
{{- end -}}

{{- define "gpuslice.agentImage" -}}
{{- include "gpuslice.imageRef" (dict "image" .Values.agent.image "defaultTag" .Chart.AppVersion) -}}
{{- end -}}

{{/*
kube-scheduler image: the given tag, else the cluster's own version without a vendor suffix
(v1.30.4-eks-a737599 -> v1.30.4), which registry.k8s.io publishes for every release. A digest
without a tag needs no version: the digest names the image.
*/}}
{{- define "gpuslice.schedulerImage" -}}
{{- $image := .Values.scheduler.image -}}
{{- $tag := $image.tag -}}
{{- if not (or $tag $image.digest) -}}
{{- $tag = regexFind "^v[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- if not $tag -}}
{{- fail (printf "scheduler.image.tag: cannot derive it from the cluster version %q; set it (or scheduler.image.digest)" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
{{- include "gpuslice.imageRef" (dict "image" $image "defaultTag" $tag) -}}
{{- end -}}

{{/* "true" when the MutatingWebhookConfiguration carries matchConditions. */}}
{{- define "gpuslice.matchConditions" -}}
{{- if eq .Values.webhook.matchConditions "enabled" -}}
{{- if semverCompare "<1.27.0-0" .Capabilities.KubeVersion.Version -}}
{{- fail (printf "webhook.matchConditions=enabled needs Kubernetes >= 1.27 (beta, on by default, from 1.28); this cluster is %s: use auto or disabled" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
true
{{- else if eq .Values.webhook.matchConditions "auto" -}}
{{- if semverCompare ">=1.28.0-0" .Capabilities.KubeVersion.Version -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* The four GPU resource names as a CEL list literal. */}}
{{- define "gpuslice.resourceNamesCEL" -}}
{{- $r := .Values.resourceNames -}}
[{{ list $r.gpu $r.memory $r.memoryPercentage $r.cores | join "', '" | printf "'%s'" }}]
{{- end -}}

{{/* Checks across values that the JSON schema cannot express. */}}
{{- define "gpuslice.validate" -}}
{{- $full := include "gpuslice.fullname" . -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $full) -}}
{{- fail (printf "the object names would start %q, which Kubernetes refuses for a Service (a lowercase letter first, then letters, digits and '-'): choose another release name or set fullnameOverride" $full) -}}
{{- end -}}
{{- if eq (int .Values.webhook.port) 10259 -}}
{{- fail "webhook.port: 10259 is the kube-scheduler's own port in the same pod; choose another" -}}
{{- end -}}
{{- $timeout := .Values.scheduler.extender.httpTimeout | toString -}}
{{- $scale := dict "h" 3600.0 "m" 60.0 "s" 1.0 "ms" 0.001 "us" 0.000001 "µs" 0.000001 "ns" 0.000000001 -}}
{{- $secs := 0.0 -}}
{{- range $part := regexFindAll "[0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h)" $timeout -1 -}}
{{- $num := regexFind "^[0-9.]+" $part -}}
{{- $secs = addf $secs (mulf (float64 $num) (get $scale (trimPrefix $num $part))) -}}
{{- end -}}
{{- if lt $secs 9.0 -}}
{{- fail (printf "scheduler.extender.httpTimeout: %s is too short: a bind may take up to 8 s to answer, so at least 9s" $timeout) -}}
{{- end -}}
{{- /* one release per cluster: two would run two schedulers of one name, each booking the same
GPUs, two agents writing one host path and two webhooks mutating every GPU pod (`lookup` sees the
cluster on install and upgrade; `helm template` sees none) */ -}}
{{- $hooks := lookup "admissionregistration.k8s.io/v1" "MutatingWebhookConfiguration" "" "" -}}
{{- range $w := (get $hooks "items" | default list) -}}
{{- $labels := dig "metadata" "labels" dict $w -}}
{{- $other := get $labels "app.kubernetes.io/instance" -}}
{{- $otherNs := dig "metadata" "annotations" "meta.helm.sh/release-namespace" $.Release.Namespace $w -}}
{{- if and (eq (get $labels "app.kubernetes.io/part-of") "gpuslice") (or (ne $other $.Release.Name) (ne $otherNs $.Release.Namespace)) -}}
{{- fail (printf "gpuslice is installed already (release %q in namespace %q): one release per cluster, or its schedulers would book the same GPUs twice; upgrade that one, or uninstall it first" $other $otherNs) -}}
{{- end -}}
{{- end -}}
{{- $r := .Values.resourceNames -}}
{{- if ne (len (uniq (list $r.gpu $r.memory $r.memoryPercentage $r.cores))) 4 -}}
{{- fail "resourceNames: the four resource names must differ" -}}
{{- end -}}
{{- if has $r.priority (list $r.gpu $r.memory $r.memoryPercentage $r.cores) -}}
{{- fail "resourceNames: priority must differ from the GPU resource names" -}}
{{- end -}}
{{- if and (eq .Values.tls.mode "cert-manager") .Values.tls.certManager.issuerRef (not .Values.tls.certManager.issuerRef.name) -}}
{{- fail "tls.certManager.issuerRef: needs a name (or leave issuerRef empty for a self-signed CA)" -}}
{{- end -}}
{{- end -}}

{{/* securityContext of the webhook pod's containers (Pod Security "restricted"). */}}
{{- define "gpuslice.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/*
apiVersion of the annotation guard's ValidatingAdmissionPolicy and its binding, from what the
cluster serves: admissionregistration.k8s.io/v1 (GA, on by default from 1.30), else v1beta1
(1.28-1.29, only where the feature gate and the beta API are turned on), else empty: no guard.
`helm install` reads this from the API server; `helm template` needs
--api-versions admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy (or .../v1beta1/...).
*/}}
{{- define "gpuslice.annotationGuardAPI" -}}
{{- if .Values.annotationGuard.enabled -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" -}}
admissionregistration.k8s.io/v1
{{- else if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1beta1/ValidatingAdmissionPolicy" -}}
admissionregistration.k8s.io/v1beta1
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The volumes the webhook adds to GPU pods (webhook/admission/mutate.py), as a CEL list.
*/}}
{{- define "gpuslice.volumeNames" -}}
['gpuslice-lib', 'gpuslice-preload', 'gpuslice-state', 'gpuslice-limits']
{{- end -}}

{{/*
The namespaces the webhook never mutates, as a JSON list: kube-system, the release namespace
and webhook.excludedNamespaces. The webhook's namespaceSelector and the annotation guard's
rule for unmutated GPU pods read the same list.
*/}}
{{- define "gpuslice.excludedNamespaces" -}}
{{- concat (list "kube-system" .Release.Namespace) .Values.webhook.excludedNamespaces | uniq | toJson -}}
{{- end }}
