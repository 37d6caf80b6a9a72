// fusegen op `softmax_jvp`: the elementwise math, shared by the CPU and CUDA kernels
//
//   out = (t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)))*exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True) + -torch.sum((t_x + -(torch.sum(t_x*where(x ==
//       torch.amax(x, -1, keepdim=True), 1, 0), -1, keepdim=True)/torch.sum(where(x ==
//       torch.amax(x, -1, keepdim=True), 1, 0), -1, keepdim=True)))*exp(x - torch.amax(x, -1,
//       keepdim=True)), -1, keepdim=True)*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x
//       - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1,
//       keepdim=True)), -1, keepdim=True))
//   d/dx = (grad*-torch.sum((t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1, keepdim=True), 1,
//       0), -1, keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)))*exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x
//       - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1,
//       keepdim=True)), -1, keepdim=True) + torch.sum(-(grad*-torch.sum((t_x +
//       -(torch.sum(t_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)))*exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True))*(exp(x -
//       torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)) +
//       -(grad*-torch.sum((t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0),
//       -1, keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)))*exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x
//       - torch.amax(x, -1, keepdim=True)), -1, keepdim=True))*(exp(x - torch.amax(x, -1,
//       keepdim=True))/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)) +
//       -grad*((t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)))*exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)), -1, keepdim=True) + (torch.sum(-(grad*(exp(x - torch.amax(x, -1,
//       keepdim=True))/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True))), -1,
//       keepdim=True) + grad/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True))*(t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0),
//       -1, keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True))))*exp(x - torch.amax(x, -1, keepdim=True)) +
//       torch.sum(-((grad*-torch.sum((t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0), -1, keepdim=True)/torch.sum(where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0), -1, keepdim=True)))*exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True) +
//       torch.sum(-(grad*-torch.sum((t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0), -1, keepdim=True)/torch.sum(where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0), -1, keepdim=True)))*exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True))*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)) +
//       -(grad*-torch.sum((t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0),
//       -1, keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)))*exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x
//       - torch.amax(x, -1, keepdim=True)), -1, keepdim=True))*(exp(x - torch.amax(x, -1,
//       keepdim=True))/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)) +
//       -grad*((t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)))*exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)), -1, keepdim=True) + (torch.sum(-(grad*(exp(x - torch.amax(x, -1,
//       keepdim=True))/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True))), -1,
//       keepdim=True) + grad/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True))*(t_x + -(torch.sum(t_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0),
//       -1, keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True))))*exp(x - torch.amax(x, -1, keepdim=True))), -1,
//       keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)*where(x == torch.amax(x, -1, keepdim=True), 1, 0)
//   d/dt_x = (torch.sum(-(grad*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x -
//       torch.amax(x, -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1,
//       keepdim=True)), -1, keepdim=True))), -1, keepdim=True) + grad/torch.sum(exp(x -
//       torch.amax(x, -1, keepdim=True)), -1, keepdim=True))*exp(x - torch.amax(x, -1,
//       keepdim=True)) + torch.sum(-((torch.sum(-(grad*(exp(x - torch.amax(x, -1,
//       keepdim=True))/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True))), -1,
//       keepdim=True) + grad/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True)))/torch.sum(where(x == torch.amax(x,
//       -1, keepdim=True), 1, 0), -1, keepdim=True), -1, keepdim=True)*where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0)
//   backward reads: grad, x, t_x; forward+backward move 32 bytes per element in float32
//     (the inputs (an auxiliary op: the double backward runs it without its forward))
//
// Generated by fusegen 0.1.0; do not edit. Regenerate with:
//   fusegen "torch.exp(x - torch.amax(x, -1, keepdim=True)) / torch.exp(x - torch.amax(x, -1,
//       keepdim=True)).sum(-1, keepdim=True)" --name softmax --inputs x
#pragma once

#include "fusegen-math.h"

namespace fusegen::op_softmax_jvp {

#ifdef FUSEGEN_RTC_HOST
// The NVRTC route's kernel source: this op's .cu (fusegen-runtime.h, RtcSource).
const RtcSource& rtc_source();
#endif

// Pass 0 over a row: what one element adds to accumulator 0.
FUSEGEN_HD void forward_pass0(float in_x, float* v) {
  v[0] = in_x;
}
FUSEGEN_HD void forward_init0(float* acc) {
  acc[0] = -INFINITY;
}
FUSEGEN_HD void forward_combine0(float* acc, const float* other) {
  acc[0] = fusegen::maximum(acc[0], other[0]);
}
FUSEGEN_HD void forward_finish0(float /*n*/, const float* acc, float* row) {
  row[0] = acc[0];
}

// Pass 1 over a row: what one element adds to accumulators 1, 2, 3.
FUSEGEN_HD void forward_pass1(float in_x, float in_t_x, const float* row, float* v) {
  const float t0 = (in_x == row[0] ? 1.0f : 0.0f);
  v[1] = in_t_x*t0;
  v[2] = t0;
  v[3] = expf(in_x - row[0]);
}
FUSEGEN_HD void forward_init1(float* acc) {
  acc[1] = 0.0f;
  acc[2] = 0.0f;
  acc[3] = 0.0f;
}
FUSEGEN_HD void forward_combine1(float* acc, const float* other) {
  acc[1] = acc[1] + other[1];
  acc[2] = acc[2] + other[2];
  acc[3] = acc[3] + other[3];
}
FUSEGEN_HD void forward_finish1(float /*n*/, const float* acc, float* row) {
  row[1] = acc[1];
  row[2] = acc[2];
  row[3] = acc[3];
}

// Pass 2 over a row: what one element adds to accumulator 4.
FUSEGEN_HD void forward_pass2(float in_x, float in_t_x, const float* row, float* v) {
  v[4] = (in_t_x + (-(row[1]/row[2])))*expf(in_x - row[0]);
}
FUSEGEN_HD void forward_init2(float* acc) {
  acc[4] = 0.0f;
}
FUSEGEN_HD void forward_combine2(float* acc, const float* other) {
  acc[4] = acc[4] + other[4];
}
FUSEGEN_HD void forward_finish2(float /*n*/, const float* acc, float* row) {
  row[4] = acc[4];
}

// The output of one element, from its inputs and the row's values, in float.
FUSEGEN_HD void forward_outputs(float in_x, float in_t_x, const float* row, float& out) {
  const float t0 = expf(in_x - row[0]);
  out = (in_t_x + (-(row[1]/row[2])))*t0/row[3] + -row[4]*(t0/row[3]/row[3]);
}

// Pass 0 over a row: what one element adds to accumulator 0.
FUSEGEN_HD void backward_pass0(float in_x, float* v) {
  v[0] = in_x;
}
FUSEGEN_HD void backward_init0(float* acc) {
  acc[0] = -INFINITY;
}
FUSEGEN_HD void backward_combine0(float* acc, const float* other) {
  acc[0] = fusegen::maximum(acc[0], other[0]);
}
FUSEGEN_HD void backward_finish0(float /*n*/, const float* acc, float* row) {
  row[0] = acc[0];
}

// Pass 1 over a row: what one element adds to accumulators 1, 2, 3, 4.
FUSEGEN_HD void backward_pass1(float dout, float in_x, float in_t_x, const float* row, float* v) {
  const float t0 = (in_x == row[0] ? 1.0f : 0.0f);
  const float t1 = expf(in_x - row[0]);
  v[1] = in_t_x*t0;
  v[2] = t0;
  v[3] = t1;
  v[4] = dout*t1;
}
FUSEGEN_HD void backward_init1(float* acc) {
  acc[1] = 0.0f;
  acc[2] = 0.0f;
  acc[3] = 0.0f;
  acc[4] = 0.0f;
}
FUSEGEN_HD void backward_combine1(float* acc, const float* other) {
  acc[1] = acc[1] + other[1];
  acc[2] = acc[2] + other[2];
  acc[3] = acc[3] + other[3];
  acc[4] = acc[4] + other[4];
}
FUSEGEN_HD void backward_finish1(float /*n*/, const float* acc, float* row) {
  row[1] = acc[1];
  row[2] = acc[2];
  row[3] = acc[3];
  row[4] = -(1.0f/row[3])*(1.0f/row[3])*acc[4];
}

// Pass 2 over a row: what one element adds to accumulators 5, 6.
FUSEGEN_HD void backward_pass2(float dout, float in_x, float in_t_x, const float* row, float* v) {
  const float t0 = expf(in_x - row[0]);
  v[5] = (in_t_x + (-(row[1]/row[2])))*t0;
  v[6] = (row[4] + dout/row[3])*t0;
}
FUSEGEN_HD void backward_init2(float* acc) {
  acc[5] = 0.0f;
  acc[6] = 0.0f;
}
FUSEGEN_HD void backward_combine2(float* acc, const float* other) {
  acc[5] = acc[5] + other[5];
  acc[6] = acc[6] + other[6];
}
FUSEGEN_HD void backward_finish2(float /*n*/, const float* acc, float* row) {
  row[5] = acc[5];
  row[6] = -(1.0f/row[2])*acc[6];
}

// Pass 3 over a row: what one element adds to accumulator 7.
FUSEGEN_HD void backward_pass3(float dout, float in_x, float in_t_x, const float* row, float* v) {
  const float t0 = dout*(-row[5]);
  const float t1 = expf(in_x - row[0]);
  const float t2 = t1/row[3]/row[3];
  v[7] = -t0*(t2/row[3]) + -(t0/row[3])*t2 + -dout*((in_t_x + (-(row[1]/row[2])))*t1/row[3]/row[3]);
}
FUSEGEN_HD void backward_init3(float* acc) {
  acc[7] = 0.0f;
}
FUSEGEN_HD void backward_combine3(float* acc, const float* other) {
  acc[7] = acc[7] + other[7];
}
FUSEGEN_HD void backward_finish3(float /*n*/, const float* acc, float* row) {
  row[7] = acc[7];
}

// Pass 4 over a row: what one element adds to accumulator 8.
FUSEGEN_HD void backward_pass4(float dout, float in_x, float in_t_x, const float* row, float* v) {
  v[8] = -((dout*(-row[5])/row[3]/row[3] + row[7] + (row[4] + dout/row[3])*(in_t_x +
      (-(row[1]/row[2]))))*expf(in_x - row[0]));
}
FUSEGEN_HD void backward_init4(float* acc) {
  acc[8] = 0.0f;
}
FUSEGEN_HD void backward_combine4(float* acc, const float* other) {
  acc[8] = acc[8] + other[8];
}
FUSEGEN_HD void backward_finish4(float /*n*/, const float* acc, float* row) {
  row[8] = acc[8];
}

// The outputs of one element, from its inputs and the row's values, in float.
FUSEGEN_HD void backward_outputs(float dout, float in_x, float in_t_x, const float* row,
    float& grad_x, float& grad_t_x) {
  const float t0 = row[4] + dout/row[3];
  const float t1 = expf(in_x - row[0]);
  const float t2 = (in_x == row[0] ? 1.0f : 0.0f);
  grad_x = (dout*(-row[5])/row[3]/row[3] + row[7] + t0*(in_t_x + (-(row[1]/row[2]))))*t1 +
      row[8]/row[2]*t2;
  grad_t_x = t0*t1 + row[6]*t2;
}

// Pass 0 over a row: what one element adds to accumulator 0.
FUSEGEN_HD void forward_pass0(double in_x, double* v) {
  v[0] = in_x;
}
FUSEGEN_HD void forward_init0(double* acc) {
  acc[0] = -INFINITY;
}
FUSEGEN_HD void forward_combine0(double* acc, const double* other) {
  acc[0] = fusegen::maximum(acc[0], other[0]);
}
FUSEGEN_HD void forward_finish0(double /*n*/, const double* acc, double* row) {
  row[0] = acc[0];
}

// Pass 1 over a row: what one element adds to accumulators 1, 2, 3.
FUSEGEN_HD void forward_pass1(double in_x, double in_t_x, const double* row, double* v) {
  const double t0 = (in_x == row[0] ? 1.0 : 0.0);
  v[1] = in_t_x*t0;
  v[2] = t0;
  v[3] = exp(in_x - row[0]);
}
FUSEGEN_HD void forward_init1(double* acc) {
  acc[1] = 0.0;
  acc[2] = 0.0;
  acc[3] = 0.0;
}
FUSEGEN_HD void forward_combine1(double* acc, const double* other) {
  acc[1] = acc[1] + other[1];
  acc[2] = acc[2] + other[2];
  acc[3] = acc[3] + other[3];
}
FUSEGEN_HD void forward_finish1(double /*n*/, const double* acc, double* row) {
  row[1] = acc[1];
  row[2] = acc[2];
  row[3] = acc[3];
}

// Pass 2 over a row: what one element adds to accumulator 4.
FUSEGEN_HD void forward_pass2(double in_x, double in_t_x, const double* row, double* v) {
  v[4] = (in_t_x + (-(row[1]/row[2])))*exp(in_x - row[0]);
}
FUSEGEN_HD void forward_init2(double* acc) {
  acc[4] = 0.0;
}
FUSEGEN_HD void forward_combine2(double* acc, const double* other) {
  acc[4] = acc[4] + other[4];
}
FUSEGEN_HD void forward_finish2(double /*n*/, const double* acc, double* row) {
  row[4] = acc[4];
}

// The output of one element, from its inputs and the row's values, in double.
FUSEGEN_HD void forward_outputs(double in_x, double in_t_x, const double* row, double& out) {
  const double t0 = exp(in_x - row[0]);
  out = (in_t_x + (-(row[1]/row[2])))*t0/row[3] + -row[4]*(t0/row[3]/row[3]);
}

// Pass 0 over a row: what one element adds to accumulator 0.
FUSEGEN_HD void backward_pass0(double in_x, double* v) {
  v[0] = in_x;
}
FUSEGEN_HD void backward_init0(double* acc) {
  acc[0] = -INFINITY;
}
FUSEGEN_HD void backward_combine0(double* acc, const double* other) {
  acc[0] = fusegen::maximum(acc[0], other[0]);
}
FUSEGEN_HD void backward_finish0(double /*n*/, const double* acc, double* row) {
  row[0] = acc[0];
}

// Pass 1 over a row: what one element adds to accumulators 1, 2, 3, 4.
FUSEGEN_HD void backward_pass1(double dout, double in_x, double in_t_x, const double* row,
    double* v) {
  const double t0 = (in_x == row[0] ? 1.0 : 0.0);
  const double t1 = exp(in_x - row[0]);
  v[1] = in_t_x*t0;
  v[2] = t0;
  v[3] = t1;
  v[4] = dout*t1;
}
FUSEGEN_HD void backward_init1(double* acc) {
  acc[1] = 0.0;
  acc[2] = 0.0;
  acc[3] = 0.0;
  acc[4] = 0.0;
}
FUSEGEN_HD void backward_combine1(double* acc, const double* other) {
  acc[1] = acc[1] + other[1];
  acc[2] = acc[2] + other[2];
  acc[3] = acc[3] + other[3];
  acc[4] = acc[4] + other[4];
}
FUSEGEN_HD void backward_finish1(double /*n*/, const double* acc, double* row) {
  row[1] = acc[1];
  row[2] = acc[2];
  row[3] = acc[3];
  row[4] = -(1.0/row[3])*(1.0/row[3])*acc[4];
}

// Pass 2 over a row: what one element adds to accumulators 5, 6.
FUSEGEN_HD void backward_pass2(double dout, double in_x, double in_t_x, const double* row,
    double* v) {
  const double t0 = exp(in_x - row[0]);
  v[5] = (in_t_x + (-(row[1]/row[2])))*t0;
  v[6] = (row[4] + dout/row[3])*t0;
}
FUSEGEN_HD void backward_init2(double* acc) {
  acc[5] = 0.0;
  acc[6] = 0.0;
}
FUSEGEN_HD void backward_combine2(double* acc, const double* other) {
  acc[5] = acc[5] + other[5];
  acc[6] = acc[6] + other[6];
}
FUSEGEN_HD void backward_finish2(double /*n*/, const double* acc, double* row) {
  row[5] = acc[5];
  row[6] = -(1.0/row[2])*acc[6];
}

// Pass 3 over a row: what one element adds to accumulator 7.
FUSEGEN_HD void backward_pass3(double dout, double in_x, double in_t_x, const double* row,
    double* v) {
  const double t0 = dout*(-row[5]);
  const double t1 = exp(in_x - row[0]);
  const double t2 = t1/row[3]/row[3];
  v[7] = -t0*(t2/row[3]) + -(t0/row[3])*t2 + -dout*((in_t_x + (-(row[1]/row[2])))*t1/row[3]/row[3]);
}
FUSEGEN_HD void backward_init3(double* acc) {
  acc[7] = 0.0;
}
FUSEGEN_HD void backward_combine3(double* acc, const double* other) {
  acc[7] = acc[7] + other[7];
}
FUSEGEN_HD void backward_finish3(double /*n*/, const double* acc, double* row) {
  row[7] = acc[7];
}

// Pass 4 over a row: what one element adds to accumulator 8.
FUSEGEN_HD void backward_pass4(double dout, double in_x, double in_t_x, const double* row,
    double* v) {
  v[8] = -((dout*(-row[5])/row[3]/row[3] + row[7] + (row[4] + dout/row[3])*(in_t_x +
      (-(row[1]/row[2]))))*exp(in_x - row[0]));
}
FUSEGEN_HD void backward_init4(double* acc) {
  acc[8] = 0.0;
}
FUSEGEN_HD void backward_combine4(double* acc, const double* other) {
  acc[8] = acc[8] + other[8];
}
FUSEGEN_HD void backward_finish4(double /*n*/, const double* acc, double* row) {
  row[8] = acc[8];
}

// The outputs of one element, from its inputs and the row's values, in double.
FUSEGEN_HD void backward_outputs(double dout, double in_x, double in_t_x, const double* row,
    double& grad_x, double& grad_t_x) {
  const double t0 = row[4] + dout/row[3];
  const double t1 = exp(in_x - row[0]);
  const double t2 = (in_x == row[0] ? 1.0 : 0.0);
  grad_x = (dout*(-row[5])/row[3]/row[3] + row[7] + t0*(in_t_x + (-(row[1]/row[2]))))*t1 +
      row[8]/row[2]*t2;
  grad_t_x = t0*t1 + row[6]*t2;
}

// The forward as a row function of 2 inputs and 1 output in the compute type T: its passes
// over a row, then the outputs of each element (fusegen-rows.h, fusegen-cuda-rows.cuh).
template <typename T>
struct Forward {
  static constexpr const char* kName = "fusegen::op_softmax_jvp::Forward";  // in the kernel source
#ifdef FUSEGEN_RTC_HOST
  static const RtcSource& source() { return rtc_source(); }
#endif
  static constexpr int kInputs = 2;
  static constexpr int kOutputs = 1;
  static constexpr int kRows = 5;    // values per row (one per accumulator)
  static constexpr int kPasses = 3;  // passes over a row before the outputs'
  // Pass p's accumulators are pass_begin(p) .. pass_begin(p + 1) - 1.
  FUSEGEN_HD static constexpr int pass_begin(int p) {
    constexpr int kBegin[] = {0, 1, 4, 5};
    return kBegin[p];
  }
  // Whether output k is one value per row (its tensor's last dimension is 1).
  FUSEGEN_HD static constexpr bool per_row(int k) {
    constexpr bool kPerRow[] = {false};
    return kPerRow[k];
  }
  // Whether input i is a gather's index: its integers arrive converted to T, not stored
  // in the op's dtype (which may not hold them: bf16 has 8 significant bits).
  FUSEGEN_HD static constexpr bool index(int i) {
    constexpr bool kIndex[] = {false, false};
    return kIndex[i];
  }
  template <int kP>
  FUSEGEN_HD void init(T* acc) const {
    if constexpr (kP == 0) {
      forward_init0(acc);
    } else if constexpr (kP == 1) {
      forward_init1(acc);
    } else if constexpr (kP == 2) {
      forward_init2(acc);
    }
  }
  template <int kP>
  FUSEGEN_HD void pass([[maybe_unused]] const T* x, [[maybe_unused]] const T* row,
                       [[maybe_unused]] T col, T* v) const {
    if constexpr (kP == 0) {
      forward_pass0(x[0], v);
    } else if constexpr (kP == 1) {
      forward_pass1(x[0], x[1], row, v);
    } else if constexpr (kP == 2) {
      forward_pass2(x[0], x[1], row, v);
    }
  }
  template <int kP>
  FUSEGEN_HD void combine(T* acc, const T* other) const {
    if constexpr (kP == 0) {
      forward_combine0(acc, other);
    } else if constexpr (kP == 1) {
      forward_combine1(acc, other);
    } else if constexpr (kP == 2) {
      forward_combine2(acc, other);
    }
  }
  template <int kP>
  FUSEGEN_HD void finish(T n, const T* acc, T* row) const {
    if constexpr (kP == 0) {
      forward_finish0(n, acc, row);
    } else if constexpr (kP == 1) {
      forward_finish1(n, acc, row);
    } else if constexpr (kP == 2) {
      forward_finish2(n, acc, row);
    }
  }
  FUSEGEN_HD void operator()([[maybe_unused]] const T* x, [[maybe_unused]] const T* row,
                             [[maybe_unused]] T col, T* y) const {
    forward_outputs(x[0], x[1], row, y[0]);
  }
};

// The backward likewise: dout and the 2 inputs it reads in, the 2 gradients out.
template <typename T>
struct Backward {
  static constexpr const char* kName = "fusegen::op_softmax_jvp::Backward";  // in the kernel source
#ifdef FUSEGEN_RTC_HOST
  static const RtcSource& source() { return rtc_source(); }
#endif
  static constexpr int kInputs = 3;
  static constexpr int kOutputs = 2;
  static constexpr int kRows = 9;    // values per row (one per accumulator)
  static constexpr int kPasses = 5;  // passes over a row before the outputs'
  // Pass p's accumulators are pass_begin(p) .. pass_begin(p + 1) - 1.
  FUSEGEN_HD static constexpr int pass_begin(int p) {
    constexpr int kBegin[] = {0, 1, 5, 7, 8, 9};
    return kBegin[p];
  }
  // Whether output k is one value per row (its tensor's last dimension is 1).
  FUSEGEN_HD static constexpr bool per_row(int k) {
    constexpr bool kPerRow[] = {false, false};
    return kPerRow[k];
  }
  // Whether input i is a gather's index: its integers arrive converted to T, not stored
  // in the op's dtype (which may not hold them: bf16 has 8 significant bits).
  FUSEGEN_HD static constexpr bool index(int i) {
    constexpr bool kIndex[] = {false, false, false};
    return kIndex[i];
  }
  template <int kP>
  FUSEGEN_HD void init(T* acc) const {
    if constexpr (kP == 0) {
      backward_init0(acc);
    } else if constexpr (kP == 1) {
      backward_init1(acc);
    } else if constexpr (kP == 2) {
      backward_init2(acc);
    } else if constexpr (kP == 3) {
      backward_init3(acc);
    } else if constexpr (kP == 4) {
      backward_init4(acc);
    }
  }
  template <int kP>
  FUSEGEN_HD void pass([[maybe_unused]] const T* x, [[maybe_unused]] const T* row,
                       [[maybe_unused]] T col, T* v) const {
    if constexpr (kP == 0) {
      backward_pass0(x[1], v);
    } else if constexpr (kP == 1) {
      backward_pass1(x[0], x[1], x[2], row, v);
    } else if constexpr (kP == 2) {
      backward_pass2(x[0], x[1], x[2], row, v);
    } else if constexpr (kP == 3) {
      backward_pass3(x[0], x[1], x[2], row, v);
    } else if constexpr (kP == 4) {
      backward_pass4(x[0], x[1], x[2], row, v);
    }
  }
  template <int kP>
  FUSEGEN_HD void combine(T* acc, const T* other) const {
    if constexpr (kP == 0) {
      backward_combine0(acc, other);
    } else if constexpr (kP == 1) {
      backward_combine1(acc, other);
    } else if constexpr (kP == 2) {
      backward_combine2(acc, other);
    } else if constexpr (kP == 3) {
      backward_combine3(acc, other);
    } else if constexpr (kP == 4) {
      backward_combine4(acc, other);
    }
  }
  template <int kP>
  FUSEGEN_HD void finish(T n, const T* acc, T* row) const {
    if constexpr (kP == 0) {
      backward_finish0(n, acc, row);
    } else if constexpr (kP == 1) {
      backward_finish1(n, acc, row);
    } else if constexpr (kP == 2) {
      backward_finish2(n, acc, row);
    } else if constexpr (kP == 3) {
      backward_finish3(n, acc, row);
    } else if constexpr (kP == 4) {
      backward_finish4(n, acc, row);
    }
  }
  FUSEGEN_HD void operator()([[maybe_unused]] const T* x, [[maybe_unused]] const T* row,
                             [[maybe_unused]] T col, T* y) const {
    backward_outputs(x[0], x[1], x[2], row, y[0], y[1]);
  }
};

}  // namespace fusegen::op_softmax_jvp
