/* meshtrain's view of libfabric: the public headers plus out-of-line wrappers for the static inline
 * calls it uses (bindgen cannot link against an inline function). Each wrapper only forwards. */
#ifndef MESHTRAIN_OFI_SHIM_H
#define MESHTRAIN_OFI_SHIM_H
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

uint32_t mt_fi_api_version(void);
struct fi_info *mt_fi_allocinfo(void);
int mt_fi_close(struct fid *fid);
int mt_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain);
int mt_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep);
int mt_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq);
int mt_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av);
int mt_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int mt_fi_enable(struct fid_ep *ep);
int mt_fi_getname(struct fid_ep *ep, void *addr, size_t *addrlen);
int mt_fi_av_insert(struct fid_av *av, const void *addr, fi_addr_t *fi_addr);
/* Registers [buf, buf + len) of memory interface `iface` (enum fi_hmem_iface; `device` is the
 * CUDA ordinal for FI_HMEM_CUDA, ignored otherwise) with the requested key `key`. */
int mt_fi_mr_regattr(struct fid_domain *domain, const void *buf, size_t len, uint64_t access,
                     uint64_t key, int iface, int device, struct fid_mr **mr);
void *mt_fi_mr_desc(struct fid_mr *mr);
int mt_fi_mr_bind_ep(struct fid_mr *mr, struct fid_ep *ep);
int mt_fi_mr_enable(struct fid_mr *mr);
ssize_t mt_fi_tsend(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest,
                    uint64_t tag, void *context);
ssize_t mt_fi_trecv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t tag,
                    void *context);
ssize_t mt_fi_cancel(struct fid_ep *ep, void *context);
ssize_t mt_fi_cq_read(struct fid_cq *cq, struct fi_cq_tagged_entry *entries, size_t count);
ssize_t mt_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *entry);
const char *mt_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data);
#endif
