/* efa_endpoint.c: a channel's libfabric side: the provider lookup (fi_info for an RDM endpoint
 * with RMA and remote CQ data; also the public probes), opening the endpoint, registering the
 * window (one key per source region), inserting the peers' addresses, closing. Internal
 * structures and helpers: efa_engine.h. */
#define _GNU_SOURCE
#include "efa_engine.h"

/* ---------------------------------------------------------------------------------------- */
/* Provider lookup: the fi_info of an RDM endpoint with RMA and remote CQ data (probe and open) */
static struct fi_info *make_hints(const char *provider, int hmem, int prov_key) {
    struct fi_info *hints = fi_allocinfo();
    if (!hints) return NULL;
    hints->ep_attr->type = FI_EP_RDM;
    /* remote CQ data is not a capability bit in 1.17 (it is an op flag); the provider's
     * domain_attr->cq_data_size says whether writes can carry it, checked in efa_get_info() */
    hints->caps = FI_RMA;
    /* our op contexts start with a struct fi_context2, so either context mode is satisfied */
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    /* modes we honour: local descs, VA-based remote addresses, endpoint binding; provider keys
     * only where the provider insists (efa), else our random keys (get_info tries both) */
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_ENDPOINT;
    if (prov_key) hints->domain_attr->mr_mode |= FI_MR_PROV_KEY;
    if (hmem) {
        /* device memory in the window: the provider must accept FI_HMEM registrations */
        hints->caps |= FI_HMEM;
        hints->domain_attr->mr_mode |= FI_MR_HMEM;
    }
    hints->domain_attr->threading = FI_THREAD_DOMAIN; /* one thread drives each domain */
    hints->domain_attr->av_type = FI_AV_TABLE;
    hints->fabric_attr->prov_name = strdup(provider);
    return hints;
}

/* fi_getinfo for provider; "tcp" also tries the RDM layering "tcp;ofi_rxm" (1.17 has no native
 * tcp RDM endpoint). Returns 0 and *out, or a libfabric error with err filled. */
int efa_get_info(const char *provider, int hmem, const char *node, struct fi_info **out,
                 char *err, size_t errlen) {
    const char *names[2] = {provider, NULL};
    char layered[80];
    if (!strchr(provider, ';')) {
        snprintf(layered, sizeof layered, "%s;ofi_rxm", provider);
        names[1] = layered;
    }
    int rc = -FI_ENODATA;
    /* node: bind the endpoint to that local address (FI_SOURCE), so tcp listens on the process
     * group's interface only */
    const char *n = (node && node[0]) ? node : NULL;
    for (int i = 0; i < 4 && names[i / 2]; i++) {
        struct fi_info *hints = make_hints(names[i / 2], hmem, i % 2);
        if (!hints) {
            set_err(err, errlen, "fi_allocinfo failed (out of memory)");
            return -FI_ENOMEM;
        }
        /* FI_HMEM exists from API 1.10 on; host windows keep the 1.9 semantics */
        rc = fi_getinfo(hmem ? FI_VERSION(1, 10) : FI_VERSION(1, 9), n, NULL, n ? FI_SOURCE : 0,
                        hints, out);
        fi_freeinfo(hints);
        if (rc == 0) {
            if ((*out)->domain_attr->cq_data_size < 4) {
                set_err(err, errlen,
                        "provider %s offers only %zu bytes of remote CQ data; the proxy needs 4 "
                        "(FI_REMOTE_CQ_DATA with a 32-bit immediate)",
                        (*out)->fabric_attr->prov_name, (size_t)(*out)->domain_attr->cq_data_size);
                fi_freeinfo(*out);
                *out = NULL;
                return -FI_ENODATA;
            }
            return 0;
        }
    }
    if (n && !hmem) {
        set_err(err, errlen,
                "fi_getinfo(prov_name=%s, FI_EP_RDM, caps=FI_RMA, bound to local address %s) failed: "
                "%s (%d); no interface of this provider holds that address (set FI_TCP_IFACE to the "
                "interface the process group uses)", provider, n, fi_strerror(-rc), rc);
        return rc;
    }
    if (hmem)
        set_err(err, errlen,
                "fi_getinfo(prov_name=%s, FI_EP_RDM, caps=FI_RMA|FI_HMEM, mr_mode FI_MR_HMEM) failed: "
                "%s (%d); this libfabric's %s provider does not offer device-memory registration "
                "(fi_info -p %s -c FI_HMEM shows it; tcp never does, efa and shm do when libfabric "
                "is built with CUDA, as the AWS EFA installer's is); use hmem='off' (host-staged)",
                provider, fi_strerror(-rc), rc, provider, provider);
    else
        set_err(err, errlen,
                "fi_getinfo(prov_name=%s, FI_EP_RDM, caps=FI_RMA, FI_AV_TABLE) failed: %s (%d); "
                "the provider is missing or lacks RMA / remote CQ data (fi_info -p %s shows what it "
                "offers; for tcp set FI_TCP_IFACE to a configured interface, e.g. lo)",
                provider, fi_strerror(-rc), rc, provider);
    return rc;
}

int efa_probe(const char *provider, char *err, size_t errlen) {
    struct fi_info *info = NULL;
    int rc = efa_get_info(provider, 0, NULL, &info, err, errlen);
    if (info) fi_freeinfo(info);
    return rc;
}

int efa_probe_hmem(const char *provider, char *err, size_t errlen) {
    struct fi_info *info = NULL;
    int rc = efa_get_info(provider, 1, NULL, &info, err, errlen);
    if (info) fi_freeinfo(info);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
#define CHECK_FI(call, what)                                                                     \
    do {                                                                                         \
        int _rc = (int)(call);                                                                   \
        if (_rc) {                                                                               \
            engine_fail(e, "rank %d channel %d: %s failed: %s (%d) [%s:%d]", e->rank, c->idx,    \
                        what, fi_strerror(-_rc), _rc, __FILE__, __LINE__);                       \
            return _rc;                                                                          \
        }                                                                                        \
    } while (0)




/* Registers window[off, off + len) with `access`; binds it to the endpoint where required. */
static int register_range(channel *c, uint64_t off, uint64_t len, uint64_t access, uint64_t key,
                          struct fid_mr **out) {
    engine *e = c->eng;
    int rc;
    if (e->hmem_cuda_device >= 0) {
        /* the window is CUDA memory: the provider (NIC DMA on efa, cudaMemcpy on tcp/shm) reads
         * and writes it directly, no host staging */
        struct iovec iov = {.iov_base = e->window + off, .iov_len = (size_t)len};
        struct fi_mr_attr attr;
        memset(&attr, 0, sizeof attr);
        attr.mr_iov = &iov;
        attr.iov_count = 1;
        attr.access = access;
        attr.requested_key = key;
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = e->hmem_cuda_device;
        rc = fi_mr_regattr(c->domain, &attr, 0, out);
    } else {
        rc = fi_mr_reg(c->domain, e->window + off, (size_t)len, access, 0, key, 0, out, NULL);
    }
    if (rc) return rc;
    if (c->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        rc = fi_mr_bind(*out, &c->ep->fid, 0);
        if (!rc) rc = fi_mr_enable(*out);
    }
    return rc;
}

int efa_channel_open(channel *c) {
    engine *e = c->eng;
    char msg[512] = {0};
    int rc = efa_get_info(e->provider, e->hmem_cuda_device >= 0, e->node, &c->info, msg, sizeof msg);
    if (rc) {
        engine_fail(e, "rank %d channel %d: %s", e->rank, c->idx, msg);
        return rc;
    }
    struct fi_info *info = c->info;
    CHECK_FI(fi_fabric(info->fabric_attr, &c->fabric, NULL), "fi_fabric");
    CHECK_FI(fi_domain(c->fabric, info, &c->domain, NULL), "fi_domain");

    struct fi_av_attr av_attr = {0};
    av_attr.type = FI_AV_TABLE;
    av_attr.count = (size_t)e->world;
    CHECK_FI(fi_av_open(c->domain, &av_attr, &c->av, NULL), "fi_av_open");

    struct fi_cq_attr cq_attr = {0};
    cq_attr.format = FI_CQ_FORMAT_DATA; /* remote completions carry the 32-bit immediate */
    cq_attr.wait_obj = FI_WAIT_NONE;    /* the thread polls; no wait object needed */
    cq_attr.size = (size_t)(e->max_inflight * 4 + 4096);
    CHECK_FI(fi_cq_open(c->domain, &cq_attr, &c->cq, NULL), "fi_cq_open");

    CHECK_FI(fi_endpoint(c->domain, info, &c->ep, NULL), "fi_endpoint");
    CHECK_FI(fi_ep_bind(c->ep, &c->av->fid, 0), "fi_ep_bind(av)");
    /* FI_RECV: remote writes with FI_REMOTE_CQ_DATA complete on the receive side of this CQ */
    CHECK_FI(fi_ep_bind(c->ep, &c->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    CHECK_FI(fi_enable(c->ep), "fi_enable");

    uint64_t mr_mode = (uint64_t)info->domain_attr->mr_mode;
    /* Two kinds of registration, no remote read anywhere: the whole window with local access
     * only (the source of our writes), and one receive region per source with remote write only,
     * each under its own random key that only that source learns; a peer's write outside its own
     * region is refused by the target's provider. */
    /* a CUDA window registers through fi_mr_regattr (FI_HMEM_CUDA): name the call that failed */
    const int cuda = e->hmem_cuda_device >= 0;
    CHECK_FI(register_range(c, 0, e->window_bytes, FI_WRITE, 0, &c->mr),
             cuda ? "fi_mr_regattr(window, FI_HMEM_CUDA, local)" : "fi_mr_reg(window, local)");
    c->mr_desc = fi_mr_desc(c->mr);
    c->mr_recv = calloc((size_t)e->num_regions, sizeof(struct fid_mr *));
    c->region_key = calloc((size_t)e->num_regions, sizeof(uint64_t));
    c->region_base = calloc((size_t)e->num_regions, sizeof(uint64_t));
    if (!c->mr_recv || !c->region_key || !c->region_base) {
        engine_fail(e, "rank %d channel %d: out of memory for registrations", e->rank, c->idx);
        return -FI_ENOMEM;
    }
    for (int r = 0; r < e->num_regions; r++) {
        uint64_t off = region_start(e, r), len = region_bytes(e);
        /* keys differ per (channel, region) because the domain is per channel */
        uint64_t key = splitmix64(e->key_seed ^ (((uint64_t)c->idx << 32) | (uint64_t)r));
        size_t ks = info->domain_attr->mr_key_size;
        if (ks && ks < 8) key &= (1ull << (8 * ks)) - 1;
        int access = FI_REMOTE_WRITE;
        if (!e->recv_stride) access |= FI_WRITE; /* one region: also our local source */
        CHECK_FI(register_range(c, off, len, access, key, &c->mr_recv[r]),
                 cuda ? "fi_mr_regattr(receive region, FI_HMEM_CUDA)" : "fi_mr_reg(receive region)");
        c->region_key[r] = fi_mr_key(c->mr_recv[r]);
        if (c->region_key[r] == FI_KEY_NOTAVAIL) {
            engine_fail(e, "rank %d channel %d: fi_mr_key returned FI_KEY_NOTAVAIL (raw keys are not "
                           "supported by this proxy)", e->rank, c->idx);
            return -FI_ENOSYS;
        }
        c->region_base[r] = (mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)(e->window + off) : 0;
    }

    c->name_len = sizeof c->name;
    CHECK_FI(fi_getname(&c->ep->fid, c->name, &c->name_len), "fi_getname");

    c->ctx = calloc((size_t)e->max_inflight, sizeof(op_ctx));
    c->held = calloc(PENDING_CAP, sizeof(held_arrival));
    if (!c->ctx || !c->held) {
        engine_fail(e, "rank %d channel %d: out of memory for contexts", e->rank, c->idx);
        return -FI_ENOMEM;
    }
    for (int i = 0; i < e->max_inflight; i++) c->ctx[i].next_free = i + 1 < e->max_inflight ? i + 1 : -1;
    c->free_ctx = 0;
    return 0;
}

int efa_channel_insert_peers(channel *c) {
    engine *e = c->eng;
    for (int r = 0; r < e->world; r++) {
        /* one insert per rank keeps the fi_addr_t <-> rank mapping explicit */
        int n = fi_av_insert(c->av, c->req_names + (size_t)r * EFA_ADDR_MAX, 1, &c->peer_addr[r], 0, NULL);
        if (n != 1) {
            engine_fail(e, "rank %d channel %d: fi_av_insert(address of rank %d) inserted %d: %s",
                        e->rank, c->idx, r, n, n < 0 ? fi_strerror(-n) : "invalid address");
            return n < 0 ? n : -FI_EINVAL;
        }
    }
    return 0;
}

void efa_channel_close(channel *c) {
    engine *e = c->eng;
    if (c->mr_recv)
        for (int r = 0; r < e->num_regions; r++)
            if (c->mr_recv[r]) {
                fi_close(&c->mr_recv[r]->fid);
                c->mr_recv[r] = NULL;
            }
    if (c->mr) fi_close(&c->mr->fid);
    if (c->ep) fi_close(&c->ep->fid);
    if (c->cq) fi_close(&c->cq->fid);
    if (c->av) fi_close(&c->av->fid);
    if (c->domain) fi_close(&c->domain->fid);
    if (c->fabric) fi_close(&c->fabric->fid);
    if (c->info) fi_freeinfo(c->info);
    c->mr = NULL; c->ep = NULL; c->cq = NULL; c->av = NULL; c->domain = NULL; c->fabric = NULL;
    c->info = NULL;
}
