/* Out-of-line forwards of libfabric's static inline calls; see shim.h. */
#include "shim.h"

uint32_t mt_fi_api_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }
struct fi_info *mt_fi_allocinfo(void) { return fi_allocinfo(); }
int mt_fi_close(struct fid *fid) { return fi_close(fid); }
int mt_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain) {
    return fi_domain(fabric, info, domain, NULL);
}
int mt_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep) {
    return fi_endpoint(domain, info, ep, NULL);
}
int mt_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq) {
    return fi_cq_open(domain, attr, cq, NULL);
}
int mt_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av) {
    return fi_av_open(domain, attr, av, NULL);
}
int mt_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags) { return fi_ep_bind(ep, bfid, flags); }
int mt_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }
int mt_fi_getname(struct fid_ep *ep, void *addr, size_t *addrlen) { return fi_getname(&ep->fid, addr, addrlen); }
int mt_fi_av_insert(struct fid_av *av, const void *addr, fi_addr_t *fi_addr) {
    return fi_av_insert(av, addr, 1, fi_addr, 0, NULL);
}
int mt_fi_mr_regattr(struct fid_domain *domain, const void *buf, size_t len, uint64_t access,
                     uint64_t key, int iface, int device, struct fid_mr **mr) {
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct fi_mr_attr attr = {0};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = key;
    attr.iface = (enum fi_hmem_iface)iface;
    if (attr.iface == FI_HMEM_CUDA)
        attr.device.cuda = device;
    return fi_mr_regattr(domain, &attr, 0, mr);
}
void *mt_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
int mt_fi_mr_bind_ep(struct fid_mr *mr, struct fid_ep *ep) { return fi_mr_bind(mr, &ep->fid, 0); }
int mt_fi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }
ssize_t mt_fi_tsend(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest,
                    uint64_t tag, void *context) {
    return fi_tsend(ep, buf, len, desc, dest, tag, context);
}
ssize_t mt_fi_trecv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t tag,
                    void *context) {
    return fi_trecv(ep, buf, len, desc, src, tag, 0, context);
}
ssize_t mt_fi_cancel(struct fid_ep *ep, void *context) { return fi_cancel(&ep->fid, context); }
ssize_t mt_fi_cq_read(struct fid_cq *cq, struct fi_cq_tagged_entry *entries, size_t count) {
    return fi_cq_read(cq, entries, count);
}
ssize_t mt_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *entry) { return fi_cq_readerr(cq, entry, 0); }
const char *mt_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data) {
    return fi_cq_strerror(cq, prov_errno, err_data, NULL, 0);
}
